"""The baseline: HuggingFace transformers `generate` with static batching, float32, on the same GGUF.

Requests are taken in workload order in fixed batches of `--batch-size`, left-padded to the batch's
longest prompt; each batch decodes greedily for its longest requested output with EOS suppressed
(`min_new_tokens` = `max_new_tokens`), the way static batching must, so a short request's slot idles
until the batch ends. Throughput counts only the tokens each request asked for, as the Sluice figures
do; the decode steps a batch spends past a request's own length are the price of static batching.

Runs in its own environment (`.venv-bench-ref`: torch CPU, transformers, gguf, accelerate), not Sluice's;
it imports nothing of Sluice but the NumPy-only `bench.dataset`. Run from the repository root:
`.venv-bench-ref/bin/python -m sluice.bench.hf_baseline --workload W.jsonl --batch-size 64 --result-json R.json`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from sluice.bench.dataset import BenchRequest, load_jsonl

DEFAULT_MODEL = Path.home() / ".cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def _batch_inputs(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    return input_ids, mask


def _generate(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, pad_id: int, streamer: BaseStreamer | None = None
) -> torch.Tensor:
    input_ids, mask = _batch_inputs(prompts, pad_id)
    return model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        streamer=streamer,
    )


class TokenClock(BaseStreamer):
    """When `generate` hands over each new token (`perf_counter` seconds); its first `put` is the prompt."""

    def __init__(self) -> None:
        self.token_times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.token_times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def run_one_at_a_time(model: torch.nn.Module, prompts: list[list[int]], outputs: list[int], pad_id: int) -> dict:
    """Each request alone (batch 1), in order: per-request send, token and end times for `bench.metrics`."""
    records = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, wanted in zip(prompts, outputs):
            clock = TokenClock()
            sent_at = time.perf_counter()
            _generate(model, [prompt], wanted, pad_id, clock)
            records.append({
                "sent_at": sent_at, "done_at": time.perf_counter(), "token_times": clock.token_times,
                "prompt_tokens": len(prompt), "output_tokens": wanted,
            })
    return {"duration_s": time.perf_counter() - start, "completed": len(prompts), "records": records}


def run_static(model: torch.nn.Module, prompts: list[list[int]], outputs: list[int], batch_size: int, pad_id: int) -> dict:
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch, wanted = prompts[first:first + batch_size], outputs[first:first + batch_size]
            ids = _generate(model, batch, max(wanted), pad_id)
            generated += ids.shape[0] * (ids.shape[1] - max(len(p) for p in batch))
    duration = time.perf_counter() - start
    prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(outputs)
    return {
        "batch_size": batch_size,
        "duration_s": duration,
        "completed": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "generated_tokens": generated,
        "request_throughput": len(prompts) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.hf_baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, required=True, help="JSONL workload (bench.dataset format)")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the GGUF file")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--one-at-a-time", action="store_true", help="each request alone, timing every token")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    load_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model.parent, gguf_file=args.model.name, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model.parent, gguf_file=args.model.name)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    print(f"loaded {args.model.name} in {time.perf_counter() - load_start:.1f} s", file=sys.stderr)

    requests: list[BenchRequest] = load_jsonl(args.workload)
    prompts = [tokenizer.encode(r.prompt) if isinstance(r.prompt, str) else list(r.prompt) for r in requests]
    outputs = [r.output_tokens for r in requests]
    with torch.inference_mode():
        _generate(model, prompts[:2], 2, pad_id)  # first-call allocations, outside the clock
    if args.one_at_a_time:
        result = run_one_at_a_time(model, prompts, outputs, pad_id)
    else:
        result = run_static(model, prompts, outputs, args.batch_size, pad_id)
    result["command"] = shlex.join(["python", "-m", "sluice.bench.hf_baseline", *sys.argv[1:]])
    result["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    result["threads"] = torch.get_num_threads()
    if args.one_at_a_time:
        print(f"HF one at a time: {result['completed']} requests in {result['duration_s']:.1f} s")
    else:
        print(
            f"HF static batch {args.batch_size}: {result['completed']} requests in {result['duration_s']:.1f} s, "
            f"{result['output_throughput']:.1f} output tok/s, {result['total_token_throughput']:.1f} total tok/s "
            f"({result['generated_tokens']} tokens generated for {result['output_tokens']} requested)"
        )
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
