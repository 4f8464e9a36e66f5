"""What open dashboards cost the engine: output tok/s under the same load with 0 and with N dashboards open.

One `sluice serve` (started here, dashboard on), then rounds of two runs each, in ABBA order so that a drift of
the machine's speed hits both arms alike: the same closed-loop load (`--max-concurrency` streams, fixed prompt and
output lengths, fresh token ids every run so that no run is served from the prefix cache) with no dashboard, and
with `--dashboards` clients reading the push stream (`/dashboard/events`) for the whole run, as open pages do.
Prints each run, the two arms' medians, and the median over rounds of the ratio of a round's two runs. On a
shared machine whose speed wanders with other jobs, wall-clock throughput is noisy; the server process's CPU
time per output token (all its threads, from /proc) hardly depends on what else runs, so it is printed too.

    python -m sluice.bench.dashboard_overhead --rounds 4 --dashboards 5
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import httpx

from sluice.bench.compare import ROOT, free_port, wait_ready
from sluice.bench.dataset import BenchRequest, LengthDistribution, SyntheticSpec, fresh_prompts, synthetic
from sluice.bench.serve import LoadConfig, command_line, run_load


@dataclass(frozen=True)
class Run:
    dashboards: int
    output_tps: float
    cpu_ms_per_token: float  # the server process's CPU time
    pushes: int  # samples the dashboards received during the run


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, all threads."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _watch(url: str, received: list[int]) -> None:
    """One open dashboard: reads the push stream until cancelled, counting the events."""
    async with httpx.AsyncClient(timeout=None) as client, client.stream("GET", url + "/dashboard/events") as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                received[0] += 1


async def measure(url: str, server_pid: int, requests: list[BenchRequest], dashboards: int,
                  max_concurrency: int) -> Run:
    received = [0]
    watchers = [asyncio.create_task(_watch(url, received)) for _ in range(dashboards)]
    await asyncio.sleep(1.5)  # connected, first sample in
    start_pushes, start_cpu = received[0], cpu_seconds(server_pid)
    records, duration_s = await run_load(requests, LoadConfig(url, max_concurrency=max_concurrency))
    pushes, cpu_s = received[0] - start_pushes, cpu_seconds(server_pid) - start_cpu
    for watcher in watchers:
        watcher.cancel()
    await asyncio.gather(*watchers, return_exceptions=True)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    tokens = sum(r.output_tokens for r in records)
    return Run(dashboards, tokens / duration_s, 1e3 * cpu_s / tokens, pushes)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.dashboard_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="pairs of runs (one per arm), in ABBA order")
    parser.add_argument("--dashboards", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=64, help="requests per run")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    fixed = lambda n: LengthDistribution(mean=n, sigma=0.0, min=n, max=n)  # noqa: E731
    workload = synthetic(SyntheticSpec(args.num_requests, prompt=fixed(args.prompt_len), output=fixed(args.output_len)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "sluice.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]
    runs: list[Run] = []
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, server, timeout_s=900)
            asyncio.run(measure(url, server.pid, fresh_prompts(workload, salt=0), 0, args.max_concurrency))  # warm-up
            arms = [0, args.dashboards]
            for round_ in range(args.rounds):
                order = arms if round_ % 2 == 0 else arms[::-1]
                for dashboards in order:
                    salt = 1 + len(runs)
                    requests = fresh_prompts(workload, salt)
                    run = asyncio.run(measure(url, server.pid, requests, dashboards, args.max_concurrency))
                    runs.append(run)
                    print(f"round {round_ + 1}: {dashboards} dashboards: {run.output_tps:.1f} output tok/s, "
                          f"server CPU {run.cpu_ms_per_token:.2f} ms/token ({run.pushes} pushes received)", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"\n{datetime.date.today()}  {command_line()}")
    print("| dashboards open | output tok/s per run | median | server CPU ms/token per run | median |")
    print("|---|---|---|---|---|")
    arms = (0, args.dashboards)
    for dashboards in arms:
        mine = [r for r in runs if r.dashboards == dashboards]
        tps, cpu = [r.output_tps for r in mine], [r.cpu_ms_per_token for r in mine]
        print(f"| {dashboards} | {', '.join(f'{v:.1f}' for v in tps)} | {statistics.median(tps):.1f} | "
              f"{', '.join(f'{v:.2f}' for v in cpu)} | {statistics.median(cpu):.2f} |")
    pairs = [sorted(runs[i:i + 2], key=lambda r: r.dashboards) for i in range(0, len(runs), 2)]
    for name, value in (("output tok/s", lambda r: r.output_tps), ("server CPU per token", lambda r: r.cpu_ms_per_token)):
        medians = [statistics.median(value(r) for r in runs if r.dashboards == d) for d in arms]
        ratios = sorted(value(with_) / value(without) for without, with_ in pairs)
        print(f"{args.dashboards} dashboards vs none, {name}: {medians[1] / medians[0] - 1:+.1%} (medians); "
              f"paired per round {', '.join(f'{r - 1:+.1%}' for r in ratios)}: median {statistics.median(ratios) - 1:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
