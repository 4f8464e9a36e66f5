"""`python -m sluice.bench.embeddings`: throughput of concurrent `/v1/embeddings` requests against a running server.

Sends `--num-requests` requests, at most `--concurrency` in flight (all at once by default), each one input of
distinct random words (so the prefix cache cannot serve one from another) of `--min-words`..`--max-words`
words, after one untimed request. Token counts come from each response's `usage`; latency is each request's
round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import shlex
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np

WORDS = ("river valley stone forest town boat salt wool news sea light engine token batch model vector page "
         "cache prefill pool night morning garden window letter market bridge music paper signal").split()


@dataclass(frozen=True)
class Result:
    latency_s: float
    prompt_tokens: int


def inputs(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


async def embed(client: httpx.AsyncClient, text: str, limit: asyncio.Semaphore) -> Result:
    async with limit:
        start = time.perf_counter()
        response = await client.post("/v1/embeddings", json={"input": text})
        response.raise_for_status()
        return Result(time.perf_counter() - start, response.json()["usage"]["prompt_tokens"])


async def run_load(url: str, texts: list[str], concurrency: int) -> tuple[list[Result], float]:
    limit = asyncio.Semaphore(concurrency)
    connections = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=connections) as client:
        await embed(client, "warm up", limit)
        start = time.perf_counter()
        results = await asyncio.gather(*(embed(client, text, limit) for text in texts))
        return results, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    texts = inputs(args.num_requests or args.concurrency, args.min_words, args.max_words, args.seed)
    results, duration = asyncio.run(run_load(args.url, texts, args.concurrency))
    latencies_ms = np.array([r.latency_s for r in results]) * 1e3
    tokens = sum(r.prompt_tokens for r in results)
    print(f"{len(results)} requests, {args.concurrency} concurrent, {tokens} input tokens, {duration:.2f} s "
          f"({datetime.date.today()})")
    print("| requests/s | input tokens/s | latency p50 ms | latency p99 ms |\n|---:|---:|---:|---:|")
    p50, p99 = np.percentile(latencies_ms, [50, 99])
    print(f"| {len(results) / duration:.1f} | {tokens / duration:.0f} | {p50:.0f} | {p99:.0f} |")
    print(f"command: {shlex.join(['python', '-m', 'sluice.bench.embeddings', *sys.argv[1:]])}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--num-requests", type=int, default=None, help="requests in all (default: --concurrency)")
    parser.add_argument("--min-words", type=int, default=8)
    parser.add_argument("--max-words", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.embeddings", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
