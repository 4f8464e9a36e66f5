"""`sluice bench server_threads`: where a serving process's CPU goes, by thread, at a given concurrency.

    sluice serve --model M --max-num-seqs 256 --max-num-batched-tokens 2048 --max-model-len 512 --port 8000 &
    sluice bench server_threads --url http://127.0.0.1:8000 --pid $! --concurrency 256 --max-tokens 480

Opens `--concurrency` streaming completions (chat completions with `--api chat`; greedy, EOS ignored), waits
until the server runs them all, then for `--window` seconds reads each thread's CPU time from /proc and the
engine's step and token counters from /metrics. It prints the CPU per engine call and per output token of the
event loop (the process's main thread: HTTP, SSE chunks, socket writes), the engine thread, and XLA's threads. The event loop and the engine share the
GIL, so their sum is the host work a device step must hide; run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time
from collections import Counter

import httpx


def thread_cpu_s(pid: int) -> Counter[str]:
    """CPU seconds (user + system) so far of the threads of `pid`: its main thread ("event loop"), its other
    Python threads ("engine": the engine's, and idle helpers; Python does not name them to the OS), and the
    rest by the name the OS knows them by (XLA's pools)."""
    ticks = os.sysconf("SC_CLK_TCK")
    cpu: Counter[str] = Counter()
    main_name = _stat(pid, pid)[0]
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, seconds = _stat(pid, int(tid))
        except FileNotFoundError:  # the thread ended
            continue
        group = "event loop" if int(tid) == pid else "engine" if name == main_name else name
        cpu[group] += seconds / ticks
    return cpu


def _stat(pid: int, tid: int) -> tuple[str, int]:
    """A thread's name and its user + system clock ticks."""
    stat = open(f"/proc/{pid}/task/{tid}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]) + int(fields[12])


API_PATHS = {"completions": "completions", "chat": "chat/completions"}


def counters(client: httpx.Client) -> tuple[float, float, float]:
    """(engine calls, output tokens, requests running) from /metrics."""
    text = client.get("/metrics").text
    value = lambda name: float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE).group(1))
    return (value("sluice_engine_steps_total"), value("sluice_generation_tokens_total"),
            value("sluice_num_requests_running"))


async def stream(client: httpx.AsyncClient, api: str, model: str, index: int, max_tokens: int) -> None:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": f"request {index}:"}]
    else:
        body["prompt"] = f"request {index}:"
    async with client.stream("POST", f"/v1/{API_PATHS[api]}", json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass


async def measure(args: argparse.Namespace) -> None:
    with httpx.Client(base_url=args.url, timeout=30) as metrics:
        model = metrics.get("/v1/models").json()["data"][0]["id"]
        limits = httpx.Limits(max_connections=args.concurrency + 8)
        async with httpx.AsyncClient(base_url=args.url, timeout=None, limits=limits) as client:
            streams = [asyncio.create_task(stream(client, args.api, model, i, args.max_tokens))
                       for i in range(args.concurrency)]
            while (await asyncio.to_thread(counters, metrics))[2] < args.concurrency:
                if failed := next((s for s in streams if s.done() and s.exception() is not None), None):
                    raise SystemExit(f"a stream failed: {failed.exception()}")
                await asyncio.sleep(0.2)
            steps0, tokens0, _ = await asyncio.to_thread(counters, metrics)
            cpu0, start = thread_cpu_s(args.pid), time.perf_counter()
            await asyncio.sleep(args.window)
            steps1, tokens1, running = await asyncio.to_thread(counters, metrics)
            cpu1, wall = thread_cpu_s(args.pid), time.perf_counter() - start
            await asyncio.gather(*streams)
    steps, tokens = steps1 - steps0, tokens1 - tokens0
    print(f"{wall:.1f} s at {args.concurrency} streams ({running:.0f} running at the end): {steps:.0f} engine calls, "
          f"{tokens:.0f} output tokens, {1e3 * wall / steps:.2f} ms per call")
    print(f"{'thread':<16} {'CPU s':>7} {'ms per call':>12} {'us per token':>13}")
    for name in sorted(cpu1, key=lambda n: cpu0.get(n, 0.0) - cpu1[n]):  # clock ticks: 10 ms apiece
        used = cpu1[name] - cpu0.get(name, 0.0)
        print(f"{name:<16} {used:7.2f} {1e3 * used / steps:12.2f} {1e6 * used / tokens:13.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench server_threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, required=True, help="the server's process id (for /proc)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=480, help="per stream: long enough to outlast the window")
    parser.add_argument("--window", type=float, default=6.0, help="seconds measured once every stream runs")
    parser.add_argument("--api", choices=sorted(API_PATHS), default="completions", help="the streams' route")
    asyncio.run(measure(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
