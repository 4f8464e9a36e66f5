"""`sluice bench routing`: prefix-aware routing against round-robin, one shared-prefix workload, in one run.

For each routing policy in turn it starts `sluice serve --replicas N --routing POLICY` (a fresh local Ray
cluster, so every policy starts with cold caches), sends the same shared-prefix workload (`--prefix-groups`,
`bench/prefix_workload.py`) through the ingress, reads each replica's prefix-cache counters, and stops the
server; then prints one table: the cached-token share (the prompt tokens each response's usage reports served
from a prefix cache, over all prompt tokens), the servers' prefix-cache hits over lookups (vLLM's
`prefix_cache_hits / queries`, where a preempted request's prompt is looked up again), each replica's hit rate,
TTFT and throughput per policy, and the first policy's ratios to the others.
A prefix cache too small to hold every group on every replica is where routing matters: round-robin makes each
replica cycle through all the groups, affinity gives each only its own.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from sluice.app.scale_out import REPLICA_HEADER
from sluice.bench import prefix_cache
from sluice.bench.compare import ROOT, free_port, wait_ready
from sluice.bench.metrics import Summary, summarize
from sluice.bench.prefix_cache import CacheCounters
from sluice.bench.serve import LoadConfig, add_dataset_arguments, command_line, load_dataset, run_load

# Sized for a 2-core CPU, where routing decides: one replica's KV pool holds its half of the 8 groups' prefixes of
# 1,024 tokens and its share of the requests in flight, not every group. 211 MiB is 4,801 float32 tokens of
# SmolLM2-135M, 300 pages of 16: 256 for 4 prefixes and 44 for the own tokens (suffix and output: 3 pages on
# average, at most 6) of the requests it runs of the 8 in flight. With room to spare, a pool holds more than half
# the groups and round-robin's share rises with it (RESULTS.md, 2026-11-29).
DEFAULT_SERVER_ARGS = ("--no-ui --max-num-seqs 16 --max-num-batched-tokens 512 --max-model-len 2048 "
                       "--kv-cache-memory 211MiB")


@dataclass(frozen=True)
class PolicyResult:
    routing: str
    summary: Summary
    cache: dict[str, CacheCounters]
    cached_tokens: int

    @property
    def cached_share(self) -> float:
        """Prompt tokens the responses' usage reports cached (at each request's first admission) over the prompt
        tokens of the completed requests."""
        return self.cached_tokens / max(self.summary.prompt_tokens, 1)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from a prefix cache over those looked up (vLLM's hits / queries)."""
        return prefix_cache.total(self.cache).hit_rate

    @property
    def hits_per_prompt_token(self) -> float:
        """Prompt tokens served from a prefix cache over the prompt tokens sent."""
        return prefix_cache.total(self.cache).hit_tokens / max(self.summary.prompt_tokens, 1)


def wait_for_replicas(url: str, replicas: int, timeout_s: float) -> None:
    """Until `replicas` replicas have answered (a request a replica serves: /health is the ingress's own): a policy
    measured while the ingress knows only some of them would place every prefix there."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only replicas {sorted(seen)} answered in {timeout_s:.0f} s")
        if httpx.get(url + "/health", timeout=30).status_code == 200:  # a replica runs
            seen.add(httpx.get(url + "/v1/models", timeout=30).headers[REPLICA_HEADER])
        time.sleep(0.1)


def run_policy(routing: str, args: argparse.Namespace, requests: list) -> PolicyResult:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "sluice.app.cli", "serve", "--replicas", str(args.replicas), "--routing", routing,
               "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.server_args)]
    log = Path(tempfile.mkstemp(prefix=f"sluice-routing-{routing}-", suffix=".log")[1])
    print(f"{routing}: {shlex.join(command)} (log {log})", flush=True)
    with log.open("wb") as sink:
        server = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, server, args.startup_timeout)
        wait_for_replicas(url, args.replicas, args.startup_timeout)
        before = prefix_cache.read(url)
        load = LoadConfig(url, "completions", None, float("inf"), args.max_concurrency, args.seed)
        records, duration = asyncio.run(run_load(requests, load))
        cache = prefix_cache.difference(prefix_cache.read(url), before)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return PolicyResult(routing, summarize(records, duration), cache, sum(r.cached_tokens for r in records if r.ok))


def report(results: list[PolicyResult], dataset: str, command: str) -> str:
    header = ("routing", "cached share", "hits / lookups", "hits / prompt tokens", "hit rate per replica",
              "TTFT p50 ms", "TTFT p90 ms", "E2E p50 ms", "output tok/s", "failed")
    rows = [header] + [(
        r.routing, f"{r.cached_share:.1%}", f"{r.hit_rate:.1%}", f"{r.hits_per_prompt_token:.1%}",
        " ".join(f"{c.hit_rate:.0%}" for c in r.cache.values()), f"{r.summary.ttft_ms.median:.0f}", f"{r.summary.ttft_ms.p90:.0f}", f"{r.summary.e2e_ms.median:.0f}",
        f"{r.summary.output_throughput:.1f}", str(r.summary.failed),
    ) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"dataset: {dataset}"] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    first = results[0]
    for other in results[1:]:
        lines.append(
            f"{first.routing} vs {other.routing}: {_ratio(first.cached_share, other.cached_share):.2f}x the cached-token "
            f"share ({_ratio(first.hit_rate, other.hit_rate):.2f}x the hits per lookup, "
            f"{_ratio(first.hits_per_prompt_token, other.hits_per_prompt_token):.2f}x the hits per prompt token), "
            f"TTFT p50 {first.summary.ttft_ms.median:.0f} vs {other.summary.ttft_ms.median:.0f} ms")
    lines.append(f"command: {command}")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataset_arguments(parser)
    # 384 requests: each group's first request (a miss wherever it goes) is 2% of them.
    parser.set_defaults(prefix_groups=8, num_requests=384, prompt_len_mean=32, prompt_len_max=64,
                        output_len_mean=16, output_len_max=32)
    parser.add_argument("--routings", default="prefix,round-robin", help="policies to compare, the first against the others")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-concurrency", type=int, default=8, help="most requests in flight")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="more `sluice serve` flags, one string")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--result-json", type=Path, default=Path("bench/out/routing.json"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench routing", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    command = command_line()
    requests, dataset = load_dataset(args)
    results = [run_policy(routing, args, requests) for routing in args.routings.split(",")]
    print(report(results, dataset, command))
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps({
        "command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"), "dataset": dataset,
        "results": [{"routing": r.routing, "cached_share": r.cached_share, "hit_rate": r.hit_rate,
                     "hits_per_prompt_token": r.hits_per_prompt_token, "summary": asdict(r.summary),
                     "prefix_cache": {k: asdict(c) for k, c in r.cache.items()}} for r in results],
    }, indent=2) + "\n")
    print(f"result: {args.result_json}")
    return 0 if all(r.summary.failed == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
