"""Speculative decoding's speed-up: the same requests with and without n-gram drafts, side by side.

Two workloads, both chat-templated for the default model and greedy (so both engines give the same tokens):
- copy-heavy: repeat a passage of *The Devil's Dictionary* (the public-domain text in tests/data), the answer begun
  with its first words, where drafts taken from the prompt are often right;
- open chat: short questions answered freely, where drafts rarely match.
Each runs closed-loop at each concurrency (that many requests in flight, a new one as one ends) on two engines
over the same loaded weights, one with `speculative="ngram"`, alternating in up to eight rounds (at least two
requests per slot each). Reports output tok/s, TPOT, the ratio, and the acceptance rate (accepted / draft
tokens) and mean accepted length (1 + accepted per drafting step) of the speculative run.

    python -m sluice.bench.speculative                 (or: sluice bench speculative ...)
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams
from sluice.model.loader import load_model
from sluice.model.tokenizer import Tokenizer

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "devils_dictionary_preface_and_a.txt"
COPY_INSTRUCTION = "Repeat the following passage exactly, word for word:"
PREFILLED_WORDS = 3
QUESTIONS = (
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "Give me a tip for learning to cook.", "What does a bee do?", "How do I boil an egg?",
    "Write a short poem about rain.", "What is gravity?", "Suggest a name for a cat.",
    "What is the largest ocean?", "How many legs does a spider have?", "Tell me a fun fact about the Moon.",
)


ROUNDS = 8  # alternations of the two engines per cell, at most


@dataclass(frozen=True)
class Run:
    """One engine's share of a (workload, concurrency) cell, over one or more rounds; `tpots` in seconds."""

    workload: str
    concurrency: int
    speculative: bool
    output_tokens: int
    seconds: float
    tpots: tuple[float, ...]
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafting_steps: int = 0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tpot_ms(self) -> float:
        return statistics.median(self.tpots) * 1e3 if self.tpots else float("nan")

    def __add__(self, other: Run) -> Run:
        return Run(self.workload, self.concurrency, self.speculative, self.output_tokens + other.output_tokens,
                   self.seconds + other.seconds, self.tpots + other.tpots, self.draft_tokens + other.draft_tokens,
                   self.accepted_tokens + other.accepted_tokens, self.drafting_steps + other.drafting_steps)


def copy_prompts(tokenizer: Tokenizer, count: int, words: int) -> list[list[int]]:
    """Passages to repeat, the assistant's turn begun with the passage's first words (a response prefill): asked
    only, the 135M model as often comments on a passage as repeats it, and prompt lookup is measured here where
    the output does repeat the input."""
    tokens = " ".join(TEXT.read_text().split()).split(" ")
    prompts = []
    for i in range(count):
        start = (i * 97) % max(1, len(tokens) - words)
        passage = " ".join(tokens[start:start + words])
        chat = tokenizer.apply_chat_template([{"role": "user", "content": f"{COPY_INSTRUCTION}\n\n{passage}"}])
        prompts.append(tokenizer.encode(chat + " ".join(tokens[start:start + PREFILLED_WORDS])))
    return prompts


def chat_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
            for i in range(count)]


async def closed_loop(engine: Engine, requests: list[tuple[list[int], SamplingParams]], concurrency: int
                      ) -> tuple[int, float, list[float]]:
    """(output tokens, seconds, per-request TPOT in seconds) of (prompt, params) requests, `concurrency` of them
    in flight (on an engine whose step loop is started)."""
    pending = list(requests)
    tpots: list[float] = []
    total = 0

    async def worker() -> None:
        nonlocal total
        while pending:
            prompt, params = pending.pop()
            times = []
            async for increment in engine.add_request([prompt], params):
                times.extend([time.perf_counter()] * len(increment.token_ids))
            total += len(times)
            if len(times) > 1:
                tpots.append((times[-1] - times[0]) / (len(times) - 1))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total, time.perf_counter() - start, tpots


def measure(engine: Engine, workload: str, prompts: list[list[int]], params: SamplingParams, concurrency: int,
            speculative: bool) -> Run:
    async def run() -> Run:
        await engine.start()
        try:
            before = engine.stats.spec
            tokens, seconds, tpots = await closed_loop(engine, [(p, params) for p in prompts], concurrency)
            after = engine.stats.spec
        finally:
            await engine.shutdown()
        spec = {}
        if before is not None and after is not None:
            spec = dict(draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
                        accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
                        drafting_steps=after.num_drafts - before.num_drafts)
        return Run(workload, concurrency, speculative, tokens, seconds, tuple(tpots), **spec)

    return asyncio.run(run())


def table(runs: list[Run]) -> str:
    lines = ["| workload | concurrency | output tok/s plain | with drafts | ratio | TPOT p50 ms plain / drafts | "
             "acceptance | mean accepted length |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for plain in (r for r in runs if not r.speculative):
        spec = next(r for r in runs if r.speculative and (r.workload, r.concurrency) == (plain.workload, plain.concurrency))
        acceptance = spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0
        length = 1 + spec.accepted_tokens / spec.drafting_steps if spec.drafting_steps else 1.0
        lines.append(f"| {plain.workload} | {plain.concurrency} | {plain.output_tok_s:.1f} | {spec.output_tok_s:.1f} | "
                     f"{spec.output_tok_s / plain.output_tok_s:.2f}x | {plain.tpot_ms:.1f} / {spec.tpot_ms:.1f} | "
                     f"{acceptance:.0%} | {length:.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    loaded = load_model(quantization=args.quantization)
    config = EngineConfig(max_num_seqs=max(args.concurrency), max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=1024, quantization=args.quantization)
    engines = {False: Engine(loaded, config, progress=False),
               True: Engine(loaded, replace(config, speculative="ngram",
                                            num_speculative_tokens=args.num_speculative_tokens), progress=False)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {"copy-heavy": lambda n: copy_prompts(loaded.tokenizer, n, args.passage_words),
                 "open chat": lambda n: chat_prompts(loaded.tokenizer, n)}
    runs = []
    for name, make in workloads.items():
        for concurrency in args.concurrency:
            prompts = make(max(args.requests_per_slot * concurrency, args.min_requests))
            # Interleaved in rounds of at least two requests per slot, so drift on the machine hits both engines.
            rounds = max(1, min(ROUNDS, len(prompts) // (2 * concurrency)))
            cell = {}
            for i in range(rounds):
                for speculative in (False, True):
                    run_ = measure(engines[speculative], name, prompts[i::rounds], params, concurrency, speculative)
                    cell[speculative] = cell[speculative] + run_ if speculative in cell else run_
            runs += [cell[False], cell[True]]
            print(f"{name} c={concurrency}: {cell[False].output_tok_s:.1f} / {cell[True].output_tok_s:.1f} tok/s "
                  f"without / with drafts", file=sys.stderr)
    print(table(runs))
    print(f"\ncommand: {shlex.join(['python', '-m', 'sluice.bench.speculative', *sys.argv[1:]])}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 32])
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests per concurrency slot")
    parser.add_argument("--min-requests", type=int, default=16,
                        help="at least this many requests per run (one at a time, 4 would take about a second)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--passage-words", type=int, default=60)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--quantization", default="auto", help="weights, as `sluice serve --quantization`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
