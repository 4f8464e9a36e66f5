"""`sluice bench soak --minutes M`: a long mixed load against a real `sluice serve`, with a SIGKILL and a restart
halfway, counting lost requests and 5xx answers and watching the server's memory.

It starts the server on the default model (`--server-args` adds flags), and `--concurrency` clients send, each in
turn, one request of every kind: a stream read to its end, a stream of `n` 1 or 2 the client hangs up on (after its
first, second or 12th event), `n`>1, stop strings, logprobs, tool calls, structured output (`response_format`
json_schema) and a bad input that must get its 4xx. After M/2 minutes of load the server is SIGKILLed with requests
in flight (those are "killed", not lost), started again, and the load resumes for M/2 minutes; then the load
drains.

Each request ends as one of: ok; rejected (a bad input's expected 4xx); killed; 5xx (an error status or an error
event of a server error, outside the kill); wrong (an unexpected 4xx, or an answer that breaks what its kind asked
for); lost (neither completed nor an error: the connection dropped outside the kill, the stream ended without
`[DONE]`, or no end within `--request-timeout`). Every `--sample-interval` seconds it reads the server's RSS
(psutil, else /proc) and KV pages in use (`sluice_kv_pages_used` on /metrics). It writes `soak.json` (summary,
samples, every request that was not ok) and `soak.png` (RSS and KV pages over time) under `--out`, prints a
summary, and exits 1 on a lost request, a 5xx, a wrong answer, or anything still held after the drain: KV pages, or
a request or sequence running or waiting. RSS growth is that of each server life, from its first samples after
`--warmup-minutes` of load to its last ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai

from sluice.bench.compare import ROOT, free_port, wait_ready
from sluice.bench.serve import command_line, served_model

# Sized for a 2-core CPU: few compiled shapes, a small KV pool, short answers.
DEFAULT_SERVER_ARGS = ("--max-num-seqs 16 --max-num-batched-tokens 256 --max-model-len 1024 "
                       "--kv-cache-memory 64MiB --log-level warning")
OUTCOMES = ("ok", "rejected", "killed", "5xx", "wrong", "lost")
FAILURES = ("5xx", "wrong", "lost")
WORDS = ("river", "lantern", "copper", "meadow", "orbit", "violet", "harbor", "pixel", "thunder", "maple",
         "quartz", "signal", "canyon", "ember", "glacier", "willow", "cipher", "saffron", "falcon", "tundra")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}
# What a request holds while the server serves it: each reads 0 once the load has drained.
HELD = ("sluice_kv_pages_used", "sluice_num_requests_running", "sluice_num_requests_waiting",
        "sluice_num_seqs_running", "sluice_num_seqs_waiting")
RSS_WINDOW = 5  # samples whose median is a life's RSS after warm-up, and at its end


class Wrong(Exception):
    """The server answered, but not what the request's kind asked for."""


class ServerError(Exception):
    """A 5xx status, or an error event of a server error inside a stream."""


class Cut(Exception):
    """The response stopped short without an error: the connection dropped, or a stream ended without [DONE]."""


@dataclass(frozen=True)
class Record:
    kind: str
    life: int
    start_s: float
    end_s: float
    outcome: str
    detail: str = ""


@dataclass(frozen=True)
class Sample:
    t_s: float
    life: int
    rss_mib: float
    kv_pages_used: int | None
    kv_pages_total: int | None
    requests_running: int | None


@dataclass
class Life:
    """One server process and the clients that talk to it."""

    number: int
    process: subprocess.Popen
    url: str
    model: str
    http: httpx.AsyncClient
    client: openai.AsyncOpenAI
    load_start_s: float = 0.0
    load_end_s: float = 0.0


@dataclass
class Soak:
    args: argparse.Namespace
    started: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    life: Life | None = None
    killed_at_s: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.started


def rss_bytes(pid: int) -> int:
    try:
        import psutil
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {pid}") from None
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess as error:
        raise ProcessLookupError(pid) from error


def gauges(metrics_text: str) -> dict[str, int]:
    return {name: int(float(value)) for name, value in re.findall(r"^(sluice_\w+) (\S+)$", metrics_text, re.MULTILINE)}


# The request kinds. Each sends one request on `life` and returns quietly when it went as its kind expects.

def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def _chat(life: Life, content: str, **fields) -> dict:
    return {"model": life.model, "messages": [{"role": "user", "content": content}], **fields}


async def _events(life: Life, path: str, body: dict) -> AsyncIterator[dict]:
    """The JSON events of a stream; an error event raises ServerError or Wrong, a missing [DONE] Cut."""
    async with life.http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            _raise_for_status(response.status_code, response.text)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                raise (ServerError if error.get("type") in ("server_error", "service_unavailable") else Wrong)(
                    f"error event: {error}")
            yield event
    raise Cut("stream ended without [DONE]")


def _raise_for_status(status: int, text: str) -> None:
    if status >= 500:
        raise ServerError(f"{status}: {text[:200]}")
    raise Wrong(f"unexpected {status}: {text[:200]}")


async def kind_stream(life: Life, rng: random.Random) -> None:
    body = _chat(life, _prompt(rng), max_tokens=rng.randint(8, 64), temperature=0.8, seed=rng.randrange(1 << 30),
                 stream=True, stream_options={"include_usage": True})
    events = [event async for event in _events(life, "/v1/chat/completions", body)]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    if finish not in (["stop"], ["length"]) or not events[-1].get("usage"):
        raise Wrong(f"stream ended with finish reasons {finish}, usage {events[-1].get('usage')}")


async def kind_hangup(life: Life, rng: random.Random) -> None:
    body = _chat(life, _prompt(rng), max_tokens=128, ignore_eos=True, stream=True, n=rng.choice((1, 2)))
    # Late in the stream, but within it: a multi-step decode call (8 steps by default, when no request waits) sends
    # its tokens as one event, so a 128-token stream may have as few as 16 events.
    leave_after = rng.choice((1, 2, 12))
    seen = 0
    async with contextlib.aclosing(_events(life, "/v1/chat/completions", body)) as events:
        async for _ in events:
            seen += 1
            if seen == leave_after:
                return  # closing the events leaves their `async with`: the connection closes mid-stream
    raise Wrong(f"a 128-token stream ended before its event {leave_after}")


async def kind_n(life: Life, rng: random.Random) -> None:
    n = rng.randint(2, 3)
    reply = await life.client.chat.completions.create(
        model=life.model, messages=[{"role": "user", "content": _prompt(rng)}], n=n, max_tokens=24, temperature=1.0)
    if sorted(c.index for c in reply.choices) != list(range(n)):
        raise Wrong(f"n={n} gave choices {[c.index for c in reply.choices]}")


async def kind_stop(life: Life, rng: random.Random) -> None:
    stop = ["\n3.", " and"]
    body = {"model": life.model, "prompt": f"List {rng.choice(WORDS)} facts, one per line:\n1.", "max_tokens": 48,
            "temperature": 0, "stop": stop}
    if rng.random() < 0.5:
        body["stream"] = True
        events = [event async for event in _events(life, "/v1/completions", body)]
        text = "".join(c["text"] for e in events for c in e["choices"])
    else:
        response = await life.http.post("/v1/completions", json=body)
        if response.status_code != 200:
            _raise_for_status(response.status_code, response.text)
        text = response.json()["choices"][0]["text"]
    if any(s in text for s in stop):
        raise Wrong(f"stop string in the text {text!r}")


async def kind_logprobs(life: Life, rng: random.Random) -> None:
    reply = await life.client.chat.completions.create(
        model=life.model, messages=[{"role": "user", "content": _prompt(rng)}], max_tokens=16, temperature=0.7,
        logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    if len(content) != reply.usage.completion_tokens or any(len(t.top_logprobs) != 3 for t in content):
        raise Wrong(f"{len(content)} logprobs for {reply.usage.completion_tokens} tokens")


async def kind_tools(life: Life, rng: random.Random) -> None:
    required = rng.random() < 0.5
    reply = await life.client.chat.completions.create(
        model=life.model, messages=[{"role": "user", "content": f"What is the weather in {rng.choice(WORDS)}?"}],
        tools=[WEATHER_TOOL], tool_choice="required" if required else "auto", parallel_tool_calls=not required,
        max_tokens=64, temperature=0.7)
    choice = reply.choices[0]
    if required and (choice.finish_reason != "tool_calls" or len(choice.message.tool_calls or []) != 1):
        raise Wrong(f"one required call ended with {choice.finish_reason}: {choice.message}")
    for call in choice.message.tool_calls or []:
        if call.function.name != "get_weather" or "city" not in json.loads(call.function.arguments):
            raise Wrong(f"tool call {call.function}")


async def kind_structured(life: Life, rng: random.Random) -> None:
    reply = await life.client.chat.completions.create(
        model=life.model, messages=[{"role": "user", "content": f"Invent a person named after {rng.choice(WORDS)}."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
        max_tokens=64, temperature=0.7)
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        person = json.loads(choice.message.content)
        if set(person) != {"name", "age"} or not isinstance(person["age"], int):
            raise Wrong(f"not a person: {choice.message.content}")


def _bad_inputs(life: Life) -> list[tuple[str, dict | bytes, int]]:
    hello = [{"role": "user", "content": "hello"}]
    return [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", {"model": life.model, "messages": hello, "temperature": -1}, 400),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": hello}, 404),
        ("/v1/chat/completions", {"model": life.model, "messages": hello, "logit_bias": {"1": 500}}, 400),
        ("/v1/chat/completions", {"model": life.model}, 400),
        ("/v1/chat/completions", {"model": life.model, "messages": hello, "tools": [WEATHER_TOOL],
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
        ("/v1/completions", {"model": life.model, "prompt": [1] * 20000, "max_tokens": 4}, 400),
    ]


async def kind_bad(life: Life, rng: random.Random) -> None:
    path, body, expected = rng.choice(_bad_inputs(life))
    if isinstance(body, bytes):
        response = await life.http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = await life.http.post(path, json=body)
    if response.status_code != expected or "message" not in response.json().get("error", {}):
        _raise_for_status(response.status_code, f"expected {expected}: {response.text}")


KINDS: dict[str, Callable[[Life, random.Random], Awaitable[None]]] = {
    "stream": kind_stream, "hangup": kind_hangup, "n": kind_n, "stop": kind_stop, "logprobs": kind_logprobs,
    "tools": kind_tools, "structured": kind_structured, "bad": kind_bad,
}


async def send(soak: Soak, life: Life, kind: str, rng: random.Random) -> Record:
    start = soak.now()
    try:
        async with asyncio.timeout(soak.args.request_timeout):
            await KINDS[kind](life, rng)
        outcome, detail = ("rejected" if kind == "bad" else "ok"), ""
    except TimeoutError:
        outcome, detail = "lost", f"no end within {soak.args.request_timeout} s"
    except (ServerError, openai.InternalServerError) as error:
        outcome, detail = "5xx", str(error)
    except (Wrong, openai.APIStatusError, json.JSONDecodeError) as error:
        outcome, detail = "wrong", f"{type(error).__name__}: {error}"
    except (Cut, httpx.TransportError, openai.APIConnectionError) as error:
        cause = f" ({type(error.__cause__).__name__}: {error.__cause__})" if error.__cause__ else ""
        outcome, detail = "lost", f"{type(error).__name__}: {error}{cause}"
    except Exception as error:  # an answer of an unexpected shape (a missing field): wrong, and the load goes on
        outcome, detail = "wrong", f"{type(error).__name__}: {error}"
    end = soak.now()
    if outcome in ("5xx", "lost") and soak.killed_at_s is not None and start <= soak.killed_at_s <= end:
        outcome = "killed"
    return Record(kind, life.number, start, end, outcome, detail)


async def client_loop(soak: Soak, life: Life, index: int, until_s: float) -> None:
    """One client: the kinds in turn, until `until_s`. The clients start spread over the kinds, so that every kind
    is sent once each client has sent len(KINDS) / concurrency requests, however slow a life's first requests."""
    rng = random.Random(soak.args.seed * 1000 + life.number * 100 + index)
    names = list(KINDS)
    turn = index * len(names) // soak.args.concurrency
    while soak.now() < until_s:  # the kill comes at the first life's `until_s`
        soak.records.append(await send(soak, life, names[turn % len(names)], rng))
        turn += 1


async def sample_forever(soak: Soak) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            life = soak.life
            if life is not None and life.process.poll() is None:
                try:
                    rss = rss_bytes(life.process.pid)
                    metrics = gauges((await http.get(life.url + "/metrics")).text)
                except (httpx.HTTPError, OSError):
                    metrics = None
                if metrics is not None and soak.life is life and life.process.poll() is None:
                    soak.samples.append(Sample(
                        soak.now(), life.number, rss / 2**20, metrics.get("sluice_kv_pages_used"),
                        metrics.get("sluice_kv_pages_total"), metrics.get("sluice_num_requests_running")))
            await asyncio.sleep(soak.args.sample_interval)


async def start_life(soak: Soak, number: int, log_dir: Path) -> Life:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "sluice.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               *shlex.split(soak.args.server_args)]
    log = log_dir / f"soak-server-{number}.log"
    print(f"[{soak.now() / 60:5.1f} min] server {number}: {shlex.join(command)} (log {log})", flush=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    await asyncio.to_thread(wait_ready, url, process, soak.args.startup_timeout)
    limits = httpx.Limits(max_connections=soak.args.concurrency + 4)
    http = httpx.AsyncClient(base_url=url, timeout=soak.args.request_timeout, limits=limits)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=soak.args.request_timeout)
    life = Life(number, process, url, await served_model(http, url), http, client)
    print(f"[{soak.now() / 60:5.1f} min] server {number} ready (pid {process.pid})", flush=True)
    return life


async def run_life(soak: Soak, life: Life, load_s: float, then_kill: bool) -> None:
    soak.life = life
    life.load_start_s = soak.now()
    until = life.load_start_s + load_s
    clients = [asyncio.ensure_future(client_loop(soak, life, i, until)) for i in range(soak.args.concurrency)]
    if then_kill:
        await asyncio.sleep(max(until - soak.now(), 0))
        soak.killed_at_s = soak.now()
        life.process.send_signal(signal.SIGKILL)
        life.process.wait()
        in_flight = sum(not c.done() for c in clients)
        print(f"[{soak.now() / 60:5.1f} min] server {life.number} SIGKILLed, {in_flight} clients in flight", flush=True)
    await asyncio.gather(*clients)
    life.load_end_s = soak.now()
    await life.http.aclose()
    await life.client.close()


async def held_after_drain(life: Life, timeout_s: float = 30) -> dict[str, int | None]:
    """The HELD gauges once they all read 0, or their last reading after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            metrics = gauges((await http.get(life.url + "/metrics")).text)
            held = {name: metrics.get(name) for name in HELD}
            if all(value == 0 for value in held.values()) or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.5)


async def soak_run(args: argparse.Namespace) -> tuple[Soak, list[Life], dict[str, int | None]]:
    soak = Soak(args)
    args.out.mkdir(parents=True, exist_ok=True)
    sampler = asyncio.ensure_future(sample_forever(soak))
    half_s = args.minutes * 30
    lives = []
    try:
        first = await start_life(soak, 1, args.out)
        lives.append(first)
        await run_life(soak, first, half_s, then_kill=True)
        second = await start_life(soak, 2, args.out)
        lives.append(second)
        await run_life(soak, second, half_s, then_kill=False)
        held = await held_after_drain(second)
        await asyncio.sleep(args.sample_interval * 2)  # the samples after the drain
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        for life in lives:
            if life.process.poll() is None:
                life.process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(life.process.wait, 120)
                except subprocess.TimeoutExpired:
                    life.process.kill()
    return soak, lives, held


def rss_growth(soak: Soak, life: Life) -> dict:
    """RSS after warm-up (median of the first samples after it) and at the life's end (median of the last)."""
    mine = [s for s in soak.samples if s.life == life.number]
    warm = [s.rss_mib for s in mine if s.t_s >= life.load_start_s + soak.args.warmup_minutes * 60]
    end = [s.rss_mib for s in mine]
    if not warm:
        raise RuntimeError(f"server {life.number}: no RSS sample after the warm-up; lengthen --minutes")
    after_warmup, at_end = statistics.median(warm[:RSS_WINDOW]), statistics.median(end[-RSS_WINDOW:])
    return {"life": life.number, "pid": life.process.pid, "load_minutes": (life.load_end_s - life.load_start_s) / 60,
            "samples": len(mine), "after_warmup_mib": after_warmup, "end_mib": at_end,
            "growth": at_end / after_warmup - 1}


def summarize(soak: Soak, lives: list[Life], held_after: dict[str, int | None]) -> dict:
    by_kind = {kind: {"sent": 0, **{o: 0 for o in OUTCOMES}} for kind in KINDS}
    for r in soak.records:
        by_kind[r.kind]["sent"] += 1
        by_kind[r.kind][r.outcome] += 1
    outcomes = Counter(r.outcome for r in soak.records)
    rss = [rss_growth(soak, life) for life in lives]
    last = soak.samples[-1] if soak.samples else None
    return {
        "requests": len(soak.records), "by_kind": by_kind, **{o: outcomes[o] for o in OUTCOMES},
        "killed_at_minutes": soak.killed_at_s / 60 if soak.killed_at_s is not None else None,
        "restarts": len(lives) - 1, "rss": rss, "rss_growth": max(r["growth"] for r in rss),
        "held_after_drain": held_after, "kv_pages_total": last.kv_pages_total if last else None,
    }


def plot(soak: Soak, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, rss_axis = plt.subplots(figsize=(10, 4))
    pages_axis = rss_axis.twinx()
    for life in sorted({s.life for s in soak.samples}):
        mine = [s for s in soak.samples if s.life == life]
        minutes = [s.t_s / 60 for s in mine]
        rss_axis.plot(minutes, [s.rss_mib for s in mine], label=f"RSS, server {life}")
        pages_axis.plot(minutes, [s.kv_pages_used or 0 for s in mine], color="grey", linewidth=0.6,
                        label="KV pages in use" if life == 1 else None)
    if soak.killed_at_s is not None:
        rss_axis.axvline(soak.killed_at_s / 60, color="red", linestyle="--", label="SIGKILL")
    rss_axis.set_xlabel("minutes")
    rss_axis.set_ylabel("RSS (MiB)")
    pages_axis.set_ylabel("KV pages in use")
    figure.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def report(summary: dict, command: str, json_path: Path, png_path: Path) -> str:
    columns = ("sent", *OUTCOMES)
    rows = [("kind", *columns)] + [(kind, *(str(counts[c]) for c in columns)) for kind, counts in summary["by_kind"].items()]
    rows.append(("all", str(summary["requests"]), *(str(summary[o]) for o in OUTCOMES)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append(f"SIGKILL at {summary['killed_at_minutes']:.1f} min: {summary['killed']} requests killed in flight; "
                 f"5xx outside it: {summary['5xx']}; lost: {summary['lost']}; wrong: {summary['wrong']}")
    for r in summary["rss"]:
        lines.append(f"server {r['life']} (pid {r['pid']}, {r['load_minutes']:.1f} min of load, {r['samples']} samples): "
                     f"RSS {r['after_warmup_mib']:.1f} MiB after warm-up, {r['end_mib']:.1f} MiB at the end "
                     f"({r['growth']:+.2%})")
    held = summary["held_after_drain"]
    lines.append(f"KV pages in use after the drain: {held['sluice_kv_pages_used']} of {summary['kv_pages_total']}; "
                 + ", ".join(f"{name.removeprefix('sluice_num_')}: {held[name]}" for name in HELD[1:]))
    lines.append(f"samples: {json_path}; plot: {png_path}")
    lines.append(f"command: {command}")
    return "\n".join(lines)


def failed(summary: dict) -> bool:
    return any(summary[o] for o in FAILURES) or any(value != 0 for value in summary["held_after_drain"].values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=10, help="minutes of load, half before the SIGKILL")
    parser.add_argument("--concurrency", type=int, default=8, help="clients, each with one request in flight")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="load per server before its RSS baseline (default: a tenth of --minutes, at most 5)")
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between RSS / KV-page samples")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds after which a request is lost")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="`sluice serve` flags, one string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="where soak.json and soak.png go")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench soak", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.warmup_minutes is None:
        args.warmup_minutes = min(args.minutes / 10, 5)
    command = command_line()
    soak, lives, held = asyncio.run(soak_run(args))
    summary = summarize(soak, lives, held)
    json_path, png_path = args.out / "soak.json", args.out / "soak.png"
    json_path.write_text(json.dumps({
        "command": command, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
        "samples": [asdict(s) for s in soak.samples],
        "not_ok": [asdict(r) for r in soak.records if r.outcome not in ("ok", "rejected")],
    }, indent=1))
    plot(soak, png_path)
    print(report(summary, command, json_path, png_path), flush=True)
    return 1 if failed(summary) else 0


if __name__ == "__main__":
    raise SystemExit(main())
