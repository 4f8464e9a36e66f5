"""int8 against float KV cache on this machine: decode steps through the engine's jitted step, and quality.

    python -m sluice.bench.kv_cache                       # steps: batch 1, 64 x context 256, 1024, both KV dtypes
    python -m sluice.bench.kv_cache --batch-sizes 1,8,64 --contexts 256,1024,2048 --repeats 9
    python -m sluice.bench.kv_cache --part quality        # greedy choices and log-probabilities against float KV

Part "steps": for each KV dtype ("auto": the activation dtype, float32 on a CPU; "int8"), an engine over the real
SmolLM2 with the weights `sluice serve` runs (`--quantization auto`) and a pool that holds the largest batch's
contexts on distinct pages, so a step reads B x C tokens of K/V from memory as a serving step does. A step is
`ModelRunner.dispatch` of B decode chunks at position C - 1 (the jitted model, attention over the pool, sampler)
and the fetch of its tokens. Medians over interleaved rounds: every (dtype, batch, context) is timed once per
round, so a change in the machine's load hits all of them alike. Also: how many tokens a pool of
`--kv-cache-memory` bytes holds in each dtype.

Part "quality": float32 weights; at each of the first 24 steps of every golden case's greedy path
(tests/data/golden_smollm2.json, teacher-forced: one `max_tokens=1` request per step), whether the greedy choice
is float's, and how far the log-probabilities of float's top 5 moved.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.kv_pool import kv_page_bytes
from sluice.batching.outputs import ListCollector
from sluice.batching.request import build_request
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.scheduler import ScheduledChunk
from sluice.model.loader import LoadedModel, load_model
from sluice.pallas_kernels.kv_cache import KV_CACHE_DTYPES, kv_cache_dtype

GOLDEN = Path(__file__).parents[1] / "tests" / "data" / "golden_smollm2.json"
PAGE_SIZE = 16
QUALITY_STEPS = 24


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int

    def __str__(self) -> str:
        return f"decode B={self.batch} C={self.context}"


def engine_for(loaded: LoadedModel, kv: str, shapes: list[Shape]) -> Engine:
    """An engine whose pool gives every sequence of the largest batch its own pages for the longest context."""
    batch, context = max(s.batch for s in shapes), max(s.context for s in shapes)
    pages = batch * -(-(context + 1) // PAGE_SIZE)  # a request is its prompt and the one token it decodes
    page_bytes = kv_page_bytes(loaded.config, PAGE_SIZE, kv_cache_dtype(kv, loaded.model.dtype))
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch, max_model_len=context + 1,
                          kv_cache_memory=pages * page_bytes, page_size=PAGE_SIZE, kv_cache_dtype=kv, warmup=False)
    return Engine(loaded, config, progress=False)


def decode_chunks(engine: Engine, shape: Shape) -> list[ScheduledChunk]:
    """B sequences of C tokens, sequence i on pages [i * C / page_size, (i + 1) * C / page_size), each decoding
    its last position."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pages_per_seq = -(-shape.context // PAGE_SIZE)
    chunks = []
    for i in range(shape.batch):
        prompt = [(7 * i + j) % 1000 + 3 for j in range(shape.context)]
        (seq,) = build_request(f"b{i}", [prompt], params, ListCollector(1), engine.tokenizer, engine.limits).seqs
        seq.page_table = list(range(i * pages_per_seq, (i + 1) * pages_per_seq))
        chunks.append(ScheduledChunk(seq, shape.context - 1, 1))
    return chunks


def time_steps(loaded: LoadedModel, args: argparse.Namespace) -> dict[tuple[str, Shape], float]:
    """Median seconds of one decode step per (KV dtype, shape), over interleaved rounds."""
    shapes = [Shape(b, c) for b in args.batch_sizes for c in args.contexts]
    steps = {}
    for kv in KV_CACHE_DTYPES:
        engine = engine_for(loaded, kv, shapes)
        for shape in shapes:
            steps[kv, shape] = (engine.runner, decode_chunks(engine, shape))
    for runner, chunks in steps.values():  # compile and warm
        runner.dispatch(chunks).fetch()
    times: dict[tuple[str, Shape], list[float]] = {key: [] for key in steps}
    for _ in range(args.repeats):
        for key, (runner, chunks) in steps.items():
            start = time.perf_counter()
            runner.dispatch(chunks).fetch()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def pool_tokens(loaded: LoadedModel, budget: int) -> dict[str, int]:
    """Tokens a pool of `budget` bytes holds, per KV dtype choice."""
    page_bytes = lambda kv: kv_page_bytes(loaded.config, PAGE_SIZE, kv_cache_dtype(kv, loaded.model.dtype))
    return {kv: budget // page_bytes(kv) * PAGE_SIZE for kv in KV_CACHE_DTYPES}


def quality() -> dict[str, dict[str, float]]:
    """Per KV dtype: top-1 agreement with float's greedy path, and the largest / median change of the log-
    probability of float's top 5 (the golden data, computed by HF transformers in float32)."""
    cases = json.loads(GOLDEN.read_text())["cases"]
    loaded = load_model(dtype="float32", quantization="none")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=True, top_logprobs=5)
    results = {}
    for kv in KV_CACHE_DTYPES:
        config = EngineConfig(max_num_seqs=len(cases), max_num_batched_tokens=128, max_model_len=256,
                              kv_cache_memory=16 << 20, kv_cache_dtype=kv, warmup=False)
        engine = Engine(loaded, config, progress=False)
        agree, moved = [], []
        for k in range(QUALITY_STEPS):
            outs = engine.generate([c["prompt_ids"] + c["greedy_ids"][:k] for c in cases], params)
            for case, out in zip(cases, outs):
                (chosen,) = out[0].logprobs
                ours = dict(chosen.top)
                agree.append(chosen.token_id == case["greedy_ids"][k])
                moved += [abs(ours[token] - logprob) for token, logprob in case["top5"][k] if token in ours]
        results[kv] = {"agreement": f"{sum(agree)}/{len(agree)}", "max_change": max(moved),
                       "median_change": statistics.median(moved)}
    return results


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return names[0] if names else platform.machine()


def header(argv: list[str]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    command = shlex.join(["python", "-m", "sluice.bench.kv_cache", *argv])
    return (f"`{command}` at {commit}, {datetime.date.today()}, "
            f"{cpu_name()} ({os.cpu_count()} CPUs), load average {load}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["steps", "quality"], default="steps")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quantization", default="auto", help="the weights (default: what `sluice serve` runs)")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="pool bytes for the capacity line")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    print(header(argv))
    if args.part == "quality":
        print("\n| KV cache | top-1 agreement | top-5 logprob change, max | median |\n|---|---:|---:|---:|")
        for kv, r in quality().items():
            print(f"| {kv} | {r['agreement']} | {r['max_change']:.3f} | {r['median_change']:.3f} |")
        return
    loaded = load_model(quantization=args.quantization)
    medians = time_steps(loaded, args)
    auto = kv_cache_dtype("auto", loaded.model.dtype).name
    print(f"\nweights: --quantization {args.quantization}; medians of {args.repeats} interleaved rounds\n")
    print(f"| step | {auto} KV | int8 KV | int8 / {auto} |\n|---|---:|---:|---:|")
    for shape in sorted({shape for _, shape in medians}, key=lambda s: (s.batch, s.context)):
        base, int8 = medians["auto", shape], medians["int8", shape]
        print(f"| {shape} | {1e3 * base:.1f} ms | {1e3 * int8:.1f} ms | {int8 / base:.2f} |")
    tokens = pool_tokens(loaded, args.kv_cache_memory)
    print(f"\nA pool of {args.kv_cache_memory / 2**30:g} GiB holds {tokens['auto']} tokens in {auto}, "
          f"{tokens['int8']} in int8.")


if __name__ == "__main__":
    main()
