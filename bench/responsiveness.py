"""`sluice bench responsiveness`: how fast /health and /metrics answer while the engine is busy.

Loads a running server with `--concurrency` streaming requests (the `bench serve` load generator, all sent
at once) and meanwhile, from a separate thread with its own connection, probes /health and /metrics every
`--interval-ms`, timing each answer. The server's event loop shares nothing with its engine thread but the
GIL, so these times show what a step's host work costs everything else the server does.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np

from sluice.bench.dataset import SyntheticSpec, synthetic
from sluice.bench.serve import LoadConfig, run_load

PROBED = ("/health", "/metrics")


@dataclass(frozen=True)
class ProbeStats:
    path: str
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, path: str, seconds: list[float]) -> ProbeStats:
        ms = np.asarray(seconds) * 1e3
        return cls(path, len(ms), *np.percentile(ms, [50, 90, 99]), float(ms.max()))


def probe(url: str, interval_s: float, stop: threading.Event) -> dict[str, list[float]]:
    """Times GETs of each probed path, round-robin, until `stop` is set."""
    times: dict[str, list[float]] = {path: [] for path in PROBED}
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            for path in PROBED:
                start = time.perf_counter()
                response = client.get(path)
                times[path].append(time.perf_counter() - start)
                response.raise_for_status()
            stop.wait(interval_s)
    return times


def run(args: argparse.Namespace, argv: list[str]) -> int:
    spec = SyntheticSpec(args.concurrency, seed=args.seed)
    requests = synthetic(spec)
    stop = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="prober") as prober:  # its failure is raised here, by `result`
        probing = prober.submit(probe, args.url, args.interval_ms / 1e3, stop)
        try:
            records, duration = asyncio.run(run_load(requests, LoadConfig(args.url, max_concurrency=args.concurrency)))
        finally:
            stop.set()
        times = probing.result()
    failed = sum(1 for r in records if not r.ok)
    tokens = sum(r.output_tokens for r in records)
    print(f"load: {args.concurrency} concurrent streaming requests ({spec.describe()}), {duration:.1f} s, "
          f"{tokens} output tokens, {failed} failed")
    print("| path | probes | p50 ms | p90 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|---:|")
    for path in PROBED:
        s = ProbeStats.of(path, times[path])
        print(f"| {s.path} | {s.count} | {s.p50_ms:.1f} | {s.p90_ms:.1f} | {s.p99_ms:.1f} | {s.max_ms:.1f} |")
    print(f"command: {shlex.join(['sluice', 'bench', 'responsiveness', *argv])}")
    return 0 if failed == 0 else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    parser.add_argument("--concurrency", type=int, default=32, help="streaming requests in flight at once")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="pause between probe rounds")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench responsiveness", description=__doc__)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run(parser.parse_args(argv), argv)


if __name__ == "__main__":
    raise SystemExit(main())
