"""Offline throughput: the continuous-batching engine against static batching and one request at a time.

All three run the same engine, so the same compiled step: (a) every request submitted at once, scheduled
per iteration; (b) static batching, requests in arrival batches of B with prompts padded to the batch's
longest and every row decoding until the batch's longest output is done; (c) one request at a time.
Outputs ignore EOS so every request produces exactly its sampled length.

    python -m sluice.bench.throughput --num-prompts 64     (or: sluice bench throughput ...)
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams
from sluice.bench.dataset import FIRST_ORDINARY_TOKEN, BenchRequest, LengthDistribution, SyntheticSpec, synthetic


@dataclass(frozen=True)
class Measurement:
    mode: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-mean", type=float, default=128)
    parser.add_argument("--prompt-sigma", type=float, default=0.8)
    parser.add_argument("--prompt-max", type=int, default=384)
    parser.add_argument("--output-mean", type=float, default=64)
    parser.add_argument("--output-sigma", type=float, default=0.6)
    parser.add_argument("--output-max", type=int, default=192)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="also the static batch size B")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool bytes (default: engine's)")
    parser.add_argument("--single-requests", type=int, default=8,
                        help="how many requests the one-at-a-time run measures (it is slow)")


def workload(args: argparse.Namespace) -> tuple[SyntheticSpec, list[BenchRequest]]:
    spec = SyntheticSpec(
        num_requests=args.num_prompts, seed=args.seed,
        prompt=LengthDistribution(args.prompt_mean, args.prompt_sigma, 8, args.prompt_max),
        output=LengthDistribution(args.output_mean, args.output_sigma, 4, args.output_max),
    )
    return spec, synthetic(spec)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_continuous(engine: Engine, requests: list[BenchRequest]) -> Measurement:
    start = time.perf_counter()
    outs = engine.generate([list(r.prompt) for r in requests], [greedy(r.output_tokens) for r in requests])
    seconds = time.perf_counter() - start
    assert [len(o[0].token_ids) for o in outs] == [r.output_tokens for r in requests]
    return Measurement("continuous", len(requests), sum(len(r.prompt) for r in requests),
                       sum(r.output_tokens for r in requests), seconds)


def run_static(engine: Engine, requests: list[BenchRequest], batch_size: int) -> Measurement:
    """Only the real prompt and output tokens count; padding and the wait for the longest are the cost."""
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        longest_prompt = max(len(r.prompt) for r in batch)
        longest_output = max(r.output_tokens for r in batch)
        padded = [[FIRST_ORDINARY_TOKEN] * (longest_prompt - len(r.prompt)) + list(r.prompt) for r in batch]
        engine.generate(padded, greedy(longest_output))
    seconds = time.perf_counter() - start
    return Measurement("static", len(requests), sum(len(r.prompt) for r in requests),
                       sum(r.output_tokens for r in requests), seconds)


def run_single(engine: Engine, requests: list[BenchRequest]) -> Measurement:
    start = time.perf_counter()
    for r in requests:
        engine.generate([list(r.prompt)], greedy(r.output_tokens))
    seconds = time.perf_counter() - start
    return Measurement("one at a time", len(requests), sum(len(r.prompt) for r in requests),
                       sum(r.output_tokens for r in requests), seconds)


def table(results: list[Measurement], static: Measurement) -> str:
    lines = [
        "| mode | requests | prompt tok | output tok | seconds | output tok/s | total tok/s | output tok/s vs static |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        lines.append(
            f"| {m.mode} | {m.num_requests} | {m.prompt_tokens} | {m.output_tokens} | {m.seconds:.1f} | "
            f"{m.output_tok_s:.1f} | {m.total_tok_s:.1f} | {m.output_tok_s / static.output_tok_s:.2f}x |"
        )
    return "\n".join(lines)


def command_line() -> str:
    """How this run was started, as it can be typed again."""
    if sys.argv[0].endswith("throughput.py"):
        return shlex.join(["python", "-m", "sluice.bench.throughput", *sys.argv[1:]])
    return shlex.join(["sluice", *sys.argv[1:]])


def run(args: argparse.Namespace) -> int:
    spec, requests = workload(args)
    config = EngineConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.prompt_max + args.output_max,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,  # static padding would share a prefix
    )
    engine = Engine.create(config)
    print(f"workload: {spec.describe()}", file=sys.stderr)
    continuous = run_continuous(engine, requests)
    print(f"continuous done in {continuous.seconds:.1f} s", file=sys.stderr)
    static = run_static(engine, requests, args.max_num_seqs)
    print(f"static done in {static.seconds:.1f} s", file=sys.stderr)
    single = run_single(engine, requests[:args.single_requests])
    stats = engine.stats
    print(f"\nworkload: {spec.describe()}")
    print(f"engine: max_num_seqs={config.max_num_seqs} (static B), max_num_batched_tokens="
          f"{config.max_num_batched_tokens}, max_model_len={engine.max_model_len}, "
          f"kv pages={stats.kv_pages_total}x{engine.config.page_size}, preemptions={stats.num_preemptions}")
    print(table([continuous, static, single], static))
    print(f"\ncontinuous / static output tok/s: {continuous.output_tok_s / static.output_tok_s:.2f}x; "
          f"continuous / one-at-a-time: {continuous.output_tok_s / single.output_tok_s:.2f}x")
    print(f"command: {command_line()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
