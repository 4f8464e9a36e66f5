"""Structured output's costs on the default model and its real vocabulary (49152 tokens).

1. Mask fill: each grammar's greedy output is replayed token by token and the mask of every position filled
   (`batching.structured.fill_bitmask`, the engine's call) for one row, and for 32 rows in one batched call
   (32 matchers in lockstep, time per row): p50 / p99 per token; the grammar's compile time, and the time its
   matcher takes to advance by a sampled token (`Grammar.advance`, on the engine thread).
2. Step time: decode steps of B sequences (B = 1 and 32), all constrained by a JSON schema that cannot end
   within the run, then all unconstrained, same prompts and lengths: median engine step (host work included),
   interleaved `--repeats` times; and the device call that applies B rows of masks (`mask_disallowed`, its
   host-to-device copy included), alone.
3. Throughput: JSON-schema chat requests (three schemas) closed-loop at concurrency 16, against the same prompts
   unconstrained with the same output lengths (each request's max_tokens set to what it wrote constrained, EOS
   ignored), so the two differ by the constraint alone; interleaved, `--repeats` times: output tok/s, and output
   tokens per CPU-second of this process (all its threads), which other load on the machine disturbs less.

    python -m sluice.bench.structured                (or: sluice bench structured ...)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace

import jax
import numpy as np

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import ListCollector
from sluice.batching.sampler import bitmask_words, mask_disallowed
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.batching.structured import GrammarCompiler, fill_bitmask
from sluice.bench.speculative import closed_loop
from sluice.model.loader import load_model

STRING = {"type": "string", "maxLength": 24}
CITY = {"type": "object", "properties": {"name": STRING, "country": STRING,
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
        "required": ["name", "country", "population"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120},
          "role": {"enum": ["admin", "user", "guest"]}, "hobbies": {"type": "array", "items": STRING, "maxItems": 3}},
          "required": ["name", "age", "role", "hobbies"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
         "type": "object", "properties": {"fruit": STRING, "price": {"type": "number", "minimum": 0, "maximum": 100}},
         "required": ["fruit", "price"], "additionalProperties": False}}, "paid": {"type": "boolean"}},
         "required": ["items", "paid"], "additionalProperties": False}
# Long enough that no sequence of the step-time runs can finish it.
RECORDS = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
           "id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": STRING, "ok": {"type": "boolean"}},
           "required": ["id", "name", "ok"], "additionalProperties": False}}
JSON_REQUESTS = [("Describe a city in JSON.", CITY), ("Invent a person in JSON.", PERSON),
                 ("Write a fruit order in JSON.", ORDER)]
SUBJECTS = ("the sea", "a library", "mountains", "trains", "a garden", "winter", "a market", "the moon")


def json_schema(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


GRAMMARS = [
    ("JSON schema: city", "Describe a city in JSON.", json_schema(CITY)),
    ("JSON schema: person (enum, array)", "Invent a person in JSON.", json_schema(PERSON)),
    ("JSON schema: order (nested, numbers)", "Write a fruit order in JSON.", json_schema(ORDER)),
    ("JSON schema: 64 records", "List some records in JSON.", json_schema(RECORDS)),
    ("json_object", "Describe a dog in JSON.", StructuredOutput("json_schema", '{"type": "object"}')),
    ("regex: phone number", "Give me a phone number.", StructuredOutput("regex", r"\(\d{3}\) \d{3}-\d{4}")),
    ("choice of 3", "What is the capital of France?", StructuredOutput("choice", '["Paris", "London", "Rome"]')),
    ("Lark grammar: arithmetic", "Write a sum.",
     StructuredOutput("grammar", 'start: expr\nexpr: NUM (("+" | "-") NUM){1,12}\nNUM: /[0-9]{1,4}/')),
]


@dataclass(frozen=True)
class FillTimes:
    name: str
    tokens: int
    compile_ms: float
    one_row_us: list[float]
    batched_us: list[float]
    advance_us: list[float]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def fill_times(compiler: GrammarCompiler, name: str, spec: StructuredOutput, tokens: list[int], rows: int
               ) -> FillTimes:
    """Times each position's mask fill along `tokens` (the grammar's own output)."""
    start = time.perf_counter()
    grammar = compiler.compile(spec)
    compile_ms = (time.perf_counter() - start) * 1e3
    lockstep = [grammar.fork() for _ in range(rows)]
    words = bitmask_words(compiler.tokenizer.vocab_size)
    one, many = np.zeros((1, words), np.int32), np.zeros((rows, words), np.int32)
    one_row_us, batched_us, advance_us = [], [], []
    for token in tokens:
        start = time.perf_counter()
        fill_bitmask([(grammar, 0, [])], one)
        one_row_us.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        fill_bitmask([(g, row, []) for row, g in enumerate(lockstep)], many)
        batched_us.append((time.perf_counter() - start) * 1e6 / rows)
        start = time.perf_counter()
        grammar.advance(token)
        advance_us.append((time.perf_counter() - start) * 1e6)
        for g in lockstep:
            g.advance(token)
    return FillTimes(name, len(tokens), compile_ms, one_row_us, batched_us, advance_us)


def chat(engine: Engine, question: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def decode_step_ms(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Median duration of the engine's decode steps over all of `prompts` at once (prefill steps excluded)."""
    for i, prompt in enumerate(prompts):
        engine.submit([prompt], params, ListCollector(1), f"step-time-{i}")
    durations = []
    while engine.has_work:
        engine.step()
        step = engine.stats.last_step
        if step is not None and step.num_prefill_tokens == 0 and step.num_seqs == len(prompts):
            durations.append(step.duration_s)
    return statistics.median(durations[1:]) * 1e3


def mask_call_ms(rows: int, vocab_size: int, calls: int = 50) -> float:
    """Median time of the device call that applies `rows` rows of masks (the engine's `mask_disallowed`)."""
    apply = jax.jit(mask_disallowed)
    logits = jax.random.normal(jax.random.key(0), (rows, vocab_size))
    allowed = np.random.default_rng(0).integers(-2**31, 2**31, (rows, bitmask_words(vocab_size))).astype(np.int32)
    jax.block_until_ready(apply(logits, allowed))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(apply(logits, allowed))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@dataclass(frozen=True)
class Throughput:
    constrained: bool
    requests: int
    output_tokens: int
    seconds: float
    cpu_seconds: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def output_tok_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_seconds


def throughput(engine: Engine, requests: list[tuple[list[int], SamplingParams]], concurrency: int,
               constrained: bool) -> Throughput:
    async def run() -> Throughput:
        await engine.start()
        cpu = time.process_time()
        try:
            tokens, seconds, _ = await closed_loop(engine, requests, concurrency)
        finally:
            await engine.shutdown()
        return Throughput(constrained, len(requests), tokens, seconds, time.process_time() - cpu)

    return asyncio.run(run())


def run(args: argparse.Namespace) -> int:
    loaded = load_model(quantization=args.quantization)
    engine = Engine(loaded, EngineConfig(max_num_seqs=max(32, args.concurrency), max_model_len=1024,
                                         quantization=args.quantization), progress=False)
    compiler = engine.grammars

    print("## Mask fill per token (real vocabulary, one row, and 32 rows in one batched call)\n")
    print("| grammar | tokens | compile ms | fill, 1 row: p50 / p99 us | fill, 32 rows: p50 / p99 us per row | "
          "advance p50 us |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, question, spec in GRAMMARS:
        out = engine.generate([chat(engine, question)], SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                                       structured=spec))[0][0]
        t = fill_times(compiler, name, spec, list(out.token_ids), 32)
        print(f"| {name} | {t.tokens} | {t.compile_ms:.2f} | {percentile(t.one_row_us, 50):.0f} / "
              f"{percentile(t.one_row_us, 99):.0f} | {percentile(t.batched_us, 50):.0f} / "
              f"{percentile(t.batched_us, 99):.0f} | {percentile(t.advance_us, 50):.0f} |", flush=True)

    print("\n## Decode step time, every row constrained vs none (median ms, host work included)\n")
    print("| batch | unconstrained | constrained (64-record JSON schema) | difference | mask call alone |")
    print("|---:|---:|---:|---:|---:|")
    # One decode step per call for both: what a constrained row adds to a step (constrained rows always take
    # single steps; the throughput comparison below runs the default engine, multi-step calls included).
    single_step = Engine(loaded, replace(engine.config, num_decode_steps=1), progress=False)
    for batch in (1, 32):
        prompts = [chat(engine, f"List some records about {SUBJECTS[i % len(SUBJECTS)]} in JSON, item {i}.")
                   for i in range(batch)]
        plain = SamplingParams(temperature=0.0, max_tokens=args.step_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.step_tokens, structured=json_schema(RECORDS))
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for is_constrained, params in ((False, plain), (True, constrained)):
                times[is_constrained].append(decode_step_ms(single_step, prompts, params))
        free, held = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {batch} | {free:.1f} | {held:.1f} | {held - free:+.1f} ms ({held / free - 1:+.1%}) | "
              f"{mask_call_ms(batch, loaded.config.vocab_size):.2f} ms |", flush=True)

    print(f"\n## JSON-schema requests at concurrency {args.concurrency} vs the same unconstrained\n")
    count = args.requests
    prompts = [chat(engine, f"{JSON_REQUESTS[i % 3][0]} Make it about {SUBJECTS[i % len(SUBJECTS)]}.")
               for i in range(count)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                  structured=json_schema(JSON_REQUESTS[i % 3][1])) for i in range(count)]
    lengths = [len(out[0].token_ids) for out in engine.generate(prompts, constrained)]  # greedy: as in the runs
    sets = {True: list(zip(prompts, constrained)),
            False: [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                    for p, n in zip(prompts, lengths)]}
    runs = [throughput(engine, sets[c], args.concurrency, c) for _ in range(args.repeats) for c in (False, True)]
    print("| run | requests | output tokens | seconds | output tok/s | CPU s | output tok per CPU-s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {'JSON schema' if r.constrained else 'unconstrained'} | {r.requests} | {r.output_tokens} | "
              f"{r.seconds:.1f} | {r.output_tok_s:.1f} | {r.cpu_seconds:.1f} | {r.output_tok_per_cpu_s:.1f} |")
    pairs = list(zip(runs[::2], runs[1::2]))
    wall = statistics.median(c.output_tok_s / u.output_tok_s for u, c in pairs)
    cpu = statistics.median(c.output_tok_per_cpu_s / u.output_tok_per_cpu_s for u, c in pairs)
    print(f"\nJSON schema / unconstrained, median over the {len(pairs)} pairs: output tok/s {wall:.3f}, "
          f"output tokens per CPU-second {cpu:.3f}")
    print(f"\ncommand: {shlex.join(['python', '-m', 'sluice.bench.structured', *sys.argv[1:]])}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48, help="requests per throughput run")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--step-tokens", type=int, default=40, help="tokens per sequence in the step-time runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantization", default="auto", help="weights, as `sluice serve --quantization`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
