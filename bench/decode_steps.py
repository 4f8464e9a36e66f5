"""Steady decode through the engine: time per output token, and the engine thread's host time per step, by
batch size and by decode steps per device call (multi-step decode).

    python -m sluice.bench.decode_steps                                  # batches 1, 8, 64; 1, 2, 4, 8 steps per call
    python -m sluice.bench.decode_steps --batch-sizes 1 --steps 1,4 --quantization none

For each (batch B, steps K): an engine with `--num-decode-steps K` (compiled once per K), B requests with
fresh random prompts of `--prompt` tokens, greedy, EOS ignored, `--output` tokens each, submitted at once and
run offline (`Engine.step` in this thread, no HTTP). Only the steps where all B sequences decode are counted:
per output token, the wall time of those steps over the tokens they produced; per step, the median of
`StepStats.host_s` (scheduling, padding and dispatch before the device's step, appending its tokens after;
the text work in between overlaps the device) and of the step's whole duration.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import numpy as np

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import ListCollector
from sluice.batching.sampling_params import SamplingParams
from sluice.bench.dataset import FIRST_ORDINARY_TOKEN


def steady_decode(engine: Engine, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    vocab = engine.limits.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = rng.integers(FIRST_ORDINARY_TOKEN, vocab, prompt_len).tolist()
        engine.submit([prompt], params, ListCollector(1), f"decode-{seed}-{i}")
    durations, hosts, tokens = [], [], 0
    while engine.has_work:
        generated = engine.stats.generation_tokens_total
        engine.step()
        step = engine.stats.last_step
        if step is not None and step.num_prefill_tokens == 0 and step.num_decode_seqs == batch:
            durations.append(step.duration_s)
            hosts.append(step.host_s)
            tokens += engine.stats.generation_tokens_total - generated
    return dict(batch=batch, ms_per_token=1e3 * sum(durations) / tokens * batch, tokens_per_s=tokens / sum(durations),
                step_ms=1e3 * statistics.median(durations), host_ms=1e3 * statistics.median(hosts),
                host_p90_ms=1e3 * float(np.percentile(hosts, 90)), steps=len(durations))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.decode_steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--steps", default="1,2,4,8", help="decode steps per device call (--num-decode-steps)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=64, help="output tokens per request")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print("python -m sluice.bench.decode_steps " + shlex.join(argv if argv is not None else sys.argv[1:]), flush=True)
    rows = []
    for k in (int(s) for s in args.steps.split(",")):
        engine = Engine.create(EngineConfig(
            quantization=args.quantization, max_num_seqs=max(batches), max_model_len=args.prompt + args.output + 16,
            num_decode_steps=k,
        ), progress=False)
        for b in batches:
            steady_decode(engine, b, args.prompt, args.output, seed=0)  # warm: every bucket of this batch ran once
            rows.append((k, steady_decode(engine, b, args.prompt, args.output, seed=1)))
            print(f"  K={k} B={b}: {rows[-1][1]}", file=sys.stderr, flush=True)
    print("\n| decode steps per call | batch | ms per output token (per sequence) | output tok/s | step ms (median) "
          "| host ms per step (median / p90) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k, r in rows:
        print(f"| {k} | {r['batch']} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} "
              f"| {r['host_ms']:.2f} / {r['host_p90_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
