"""The engine offline on random weights with a real model's shapes: throughput, latency, where a step's time goes.

    python -m sluice.bench.engine_check --model llama-3-8b --peaks peaks.json --out engine.json

Needs no model files and no HTTP stack: weights are random (`model.llama.Llama`'s own init) and the
tokenizer is a file-free word-level vocabulary of the model's size (prompts are token ids, outputs ignore
EOS, so the text is never read). For each concurrency C, on a fixed seeded variable-length workload:

- throughput: requests in waves of C (one `Engine.generate` call per wave; C = 1 runs the first
  MIN_REQUESTS requests one at a time), output and total tokens per second of wall time; and sustained
  throughput, as a server under load (and vLLM's throughput benchmark) sees it: SUSTAINED_WAVES x C requests
  with C kept in flight, the next sent as each ends, so the batch stays full but for the last wave's tail (a
  wave's own tail runs at a fraction of C: its longest output is twice the mean);
- TTFT and TPOT: the first C requests' lengths with fresh prompts, all sent at once, each token's arrival
  timed as a client would see it, over the first 1 + tpot_steps tokens of each (they ask for a multi-step
  call's more, so the calls that end them fall outside). TTFT: until every one of them has its first token
  (prefill of all C prompts plus one sample); TPOT: vLLM's per request (last - first arrival) / (tokens - 1),
  averaged over the wave, i.e. the engine's real decode at batch C, multi-step calls and host work included,
  and the other requests' prefill that a request's tokens wait through; decode TPOT: the same wave's time per
  token once every request decodes (`steady_decode_s`), without that prefill (each a median of
  `latency_repeats` runs);
- step breakdown, timed directly (jitted, outside the engine, medians after a compile; every level's step
  compiles first, on a thread each): a decode step at batch C and the wave's mean context (model forward +
  LM head + argmax), the paged attention of all layers alone, the LM head + argmax alone; the report adds
  the rest, and TPOT minus the step (what the engine adds: sampler, host work, bucket padding). It also turns
  the step's byte floor (weights + the batch's K/V, read once) into a share of the measured bandwidth, and the
  workload's output tok/s into a share of `bench.roofline`'s bound;
- compile time: building the `Engine`, which compiles every step bucket (persistent cache cold when
  SLUICE_JAX_CACHE points at an empty folder, as `bench.gpu_check` arranges); where the host decides the
  sampler's plans, for this run's plan alone (a server compiles greedy's and plain sampling's).

Requests decode greedily unless `--temperature` (and `--top-p`) make them sample. Each level records how many
programs compiled while it ran, on the engine thread (a stall, its time in the figures) and off it (a sampler plan
met after warm-up: its steps run single, with the sampler of every pass, until it is compiled).
Every request's output length is checked against what was asked (a wrong count fails the run). Results
go to `--out` as JSON after each stage, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.kv_pool import default_kv_cache_bytes
from sluice.batching.outputs import Increment
from sluice.batching.sampler import SAMPLER_BRANCHES
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.stats import StepStats
from sluice.bench.device_profile import DeviceTrace
from sluice.bench.host_phases import PhaseTimer
from sluice.bench.dataset import BenchRequest, LengthDistribution, SyntheticSpec, fresh_prompts, synthetic
from sluice.bench.roofline import Peaks, ServedModel, kv_bytes_per_token, workload_roofline
from sluice.model.config import ModelConfig, RopeScaling
from sluice.model.llama import LAYER_LOOPS, KVCache, Llama, empty_kv_cache, resolve_layer_loop
from sluice.model.loader import LoadedModel
from sluice.model.paged_attend import AttentionMetadata, flat_pool, make_paged_attend
from sluice.model.quantize import QUANTIZATIONS, quantize_model
from sluice.model.roofline import StepCost, param_bytes
from sluice.model.tokenizer import SpecialTokens, Tokenizer
from sluice.pallas_kernels.attention import ragged_paged_attention, resolve_backend
from sluice.pallas_kernels.kv_cache import kv_cache_dtype

# Real shapes (from the models' published config.json); weights are random.
MODELS = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001,),
    ),
    "llama-3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
        eos_token_ids=(128001,),
    ),
    # For the CPU run: the same steps at a size that finishes in seconds.
    "tiny": ModelConfig.tiny(vocab_size=512),
}
DTYPE = "bfloat16"
PAGE_SIZE = 16
MIN_REQUESTS = 4
SUSTAINED_WAVES = 4
SUSTAINED_TRACED_STEPS = 24


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big a run is: the GPU sizes by default, `small()` for a CPU."""

    # 1,024 and 8,192 tokens per step: a server's defaults on an 80 GB GPU (`batching.config.default_batch`).
    concurrency: tuple[int, ...] = (1, 64, 256, 1024)
    prompt: LengthDistribution = LengthDistribution(mean=192, sigma=0.8, min=16, max=512)
    output: LengthDistribution = LengthDistribution(mean=96, sigma=0.6, min=8, max=192)
    tpot_steps: int = 32
    max_num_batched_tokens: int = 8192
    max_model_len: int = 1024
    timing_repeats: int = 10
    latency_repeats: int = 1  # runs of each TTFT/TPOT measurement (median)

    @classmethod
    def small(cls) -> Sizes:
        return cls(
            concurrency=(1, 4), prompt=LengthDistribution(24, 0.5, 4, 48), output=LengthDistribution(8, 0.5, 2, 16),
            tpot_steps=8, max_num_batched_tokens=16, max_model_len=128, timing_repeats=3, latency_repeats=3,
        )


def kv_pool_bytes(config: ModelConfig, workload: list[BenchRequest], sustained_requests: list[BenchRequest],
                  sizes: Sizes, page_size: int) -> int:
    """A KV pool that holds the largest wave whole (no preemption), or the C longest of `sustained_requests`
    (`sustained_workload`), and at least the engine's context, with a quarter to spare (`run` caps it at the
    engine's default, most of the free memory).

    Sized from the workload rather than the engine's default (most of the free memory): the figures then
    do not depend on the device's size. The pool's dtype is the engine's (`kv_cache_dtype`: float32 on a CPU).
    """
    longest = sorted((len(r.prompt) + r.output_tokens + page_size for r in sustained_requests), reverse=True)

    def wave_tokens(wave: list[BenchRequest]) -> int:
        timed = timed_max_tokens(wave, 1 + sizes.tpot_steps, EngineConfig.num_decode_steps,
                                 sizes.max_num_batched_tokens)
        return sum(len(r.prompt) + max(r.output_tokens, timed) + page_size for r in wave)

    tokens = max(wave_tokens(wave) for c in sizes.concurrency for wave in waves(workload, c))
    tokens = max(tokens, sum(longest[:max(sizes.concurrency)]), sizes.max_model_len)
    return int(1.25 * tokens * kv_bytes_per_token(config, kv_cache_dtype("auto", DTYPE)))


def waves(workload: list[BenchRequest], c: int) -> list[list[BenchRequest]]:
    """The throughput run at concurrency c: the first max(c, MIN_REQUESTS) requests, c at a time."""
    requests = workload[:max(c, MIN_REQUESTS)]
    return [requests[i:i + c] for i in range(0, len(requests), c)]


def sustained_workload(sizes: Sizes, vocab_size: int) -> list[BenchRequest]:
    """The sustained run's requests (`sustained`): SUSTAINED_WAVES times the largest level's, with the waves'
    length distributions and a seed of their own; level C serves the first SUSTAINED_WAVES x C."""
    return synthetic(SyntheticSpec(num_requests=SUSTAINED_WAVES * max(*sizes.concurrency, MIN_REQUESTS), seed=1,
                                   prompt=sizes.prompt, output=sizes.output, vocab_size=vocab_size))


PRINTABLE = [chr(c) for c in range(ord("!"), ord("~") + 1)]


def file_free_tokenizer(config: ModelConfig) -> Tokenizer:
    """A byte-level vocabulary, as the models' own: GPT-2's 256 byte characters, then tokens of two or more
    printable characters (token i >= 256 spells i - 256 + 94 in base 94). The engine detokenizes every output
    token as it would a real model's, without the model's files."""
    tokens = pre_tokenizers.ByteLevel.alphabet()
    for i in range(len(PRINTABLE), config.vocab_size - len(tokens) + len(PRINTABLE)):
        digits = []
        while i:
            i, digit = divmod(i, len(PRINTABLE))
            digits.append(PRINTABLE[digit])
        tokens.append("".join(reversed(digits)))
    backend = HFTokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=[]))
    backend.decoder = decoders.ByteLevel()
    special = SpecialTokens(bos_token_id=config.bos_token_id, eos_token_ids=config.eos_token_ids, add_bos=False,
                            chat_template=None)
    return Tokenizer(backend, special)


def random_model(name: str, quantization: str = "none") -> LoadedModel:
    """Random weights of the model's real shapes, in DTYPE, stored as `quantization` says ("none", "int8", "int4")."""
    config = MODELS[name]
    model = quantize_model(Llama(config, dtype=jnp.dtype(DTYPE), rngs=nnx.Rngs(0)), quantization)
    return LoadedModel(config=config, model=model, tokenizer=file_free_tokenizer(config), name=f"{name}-random")


def memory_shortfall(config: ModelConfig) -> str | None:
    """Why the device cannot hold this model with room for a KV pool and activations, or None if it can."""
    needed = 1.5 * param_bytes(nnx.eval_shape(lambda: Llama(config, dtype=jnp.dtype(DTYPE), rngs=nnx.Rngs(0))))
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit is not None and limit < needed:
        return f"needs about {needed / 2**30:.1f} GiB (weights x 1.5), the device offers {limit / 2**30:.1f} GiB"
    return None


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How every request of a run picks its tokens: greedy by default, else sampled at `temperature` from the
    `top_p` nucleus (the sampler's filter passes then run too)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=max_tokens, ignore_eos=True)


def generate_checked(engine: Engine, requests: list[BenchRequest], decoding: Decoding) -> float:
    """Runs the requests in one generate call; returns its wall seconds. Every output must have its length."""
    start = time.perf_counter()
    outs = engine.generate([list(r.prompt) for r in requests], [decoding.params(r.output_tokens) for r in requests])
    seconds = time.perf_counter() - start
    got = [len(o[0].token_ids) for o in outs]
    want = [r.output_tokens for r in requests]
    if got != want:
        raise AssertionError(f"the engine produced {got} tokens where {want} were asked")
    return seconds


class ArrivalTimes:
    """An output sink that keeps when each of a request's tokens arrived (seconds of `time.perf_counter`)."""

    def __init__(self, on_finish: Callable[[], None] = lambda: None) -> None:
        self.times: list[float] = []
        self.on_finish = on_finish

    def put(self, increment: Increment) -> None:
        if increment.error is not None:
            raise AssertionError(f"a request failed in the engine: {increment.error}")
        self.times += [time.perf_counter()] * len(increment.token_ids)
        if increment.finish_reason is not None:
            self.on_finish()


def steady_decode_s(arrivals: list[list[float]], tokens: int) -> float:
    """Seconds per token per request while every request decodes: from the last request's first token until the
    earliest moment one request has `tokens - 1` tokens more than it had then, the C requests' tokens delivered in
    between (after the first of those moments, up to the second) over C x that time. Tokens a multi-step call
    delivers together count whole. A request admitted first has decoded through the others' prefill, one token a
    step, and counting from its own first token would end the window a few steps after it starts (at 1,024
    requests and 24 prefill steps, all but 9 of 32). The requests run on past the window (`timed_max_tokens`), so
    every call in it is full: a call that ends requests runs its whole length for the rows still going, and would
    count as time without their tokens."""
    decoding_from = max(times[0] for times in arrivals)
    ends = [bisect.bisect_right(times, decoding_from) + tokens - 2 for times in arrivals]
    if any(end >= len(times) for end, times in zip(ends, arrivals)):
        raise AssertionError(f"a request of the timed wave ended before its {tokens - 1} decode tokens")
    until = min(times[end] for end, times in zip(ends, arrivals))
    counted = sum(decoding_from < t <= until for times in arrivals for t in times)
    return len(arrivals) * (until - decoding_from) / counted if counted else float("nan")


class ClosedLoop:
    """c clients, each sending its next request as soon as its last ends, over `requests` in order."""

    def __init__(self, engine: Engine, requests: list[BenchRequest], c: int, decoding: Decoding):
        self.engine, self.requests, self.c, self.decoding = engine, requests, c, decoding
        self.sinks = [ArrivalTimes(self._one_finished) for _ in requests]
        self.submitted = self.finished = 0

    def _one_finished(self) -> None:
        self.finished += 1

    @property
    def running(self) -> bool:
        return self.submitted < len(self.requests) or self.engine.has_work

    @property
    def tokens(self) -> int:
        return sum(len(sink.times) for sink in self.sinks)

    def step(self) -> None:
        """Sends what the clients may send now, then steps the engine once."""
        for i in range(self.submitted, min(len(self.requests), self.finished + self.c)):
            request = self.requests[i]
            self.engine.submit([list(request.prompt)], self.decoding.params(request.output_tokens), self.sinks[i],
                               f"sustained-{i}")
            self.submitted += 1
        self.engine.step()

    def run_while(self, going: Callable[[], bool]) -> float:
        """Steps while there is work and `going()`; returns the wall seconds it took."""
        start = time.perf_counter()
        while self.running and going():
            self.step()
        return time.perf_counter() - start


def sustained(engine: Engine, requests: list[BenchRequest], c: int, decoding: Decoding, traced_steps: int = 0
              ) -> tuple[float, dict | None]:
    """Runs the requests as a `ClosedLoop` of c clients; returns the wall seconds until the last ends, and, with
    `traced_steps`, the profile of that many engine steps once c requests have ended (the steady state: prompts
    arrive as others end), as `profiled_decode`'s plus the window's output and prompt tokens per second and its
    `mixed_steps`. The tracer's start and processing are left out of the seconds. Every output must have its
    length."""
    loop = ClosedLoop(engine, requests, c, decoding)
    seconds = loop.run_while(lambda: not traced_steps or loop.finished < c)
    profile = None
    if traced_steps and loop.running:
        with DeviceTrace() as trace:
            start = time.perf_counter()
            loop.step()  # collects the step that ran while the tracer started (`DeviceTrace.window`)
            seconds += time.perf_counter() - start
            tokens, prompt_tokens, ran = loop.tokens, engine.stats.prompt_tokens_total, []
            timer = PhaseTimer(engine)
            with trace.window():
                start = time.perf_counter()
                while loop.running and len(ran) < traced_steps:
                    loop.step()
                    ran.append(engine.stats.last_step)
                window_s = time.perf_counter() - start
            timer.close()
        seconds += window_s
        profile = {**traced_profile(trace, timer, len(ran)),
                   "output_tok_s": (loop.tokens - tokens) / window_s,
                   "prompt_tok_s": (engine.stats.prompt_tokens_total - prompt_tokens) / window_s,
                   "mixed_steps": mixed_steps(engine, [step for step in ran if step is not None])}
    seconds += loop.run_while(lambda: True)
    got, want = [len(sink.times) for sink in loop.sinks], [r.output_tokens for r in requests]
    if got != want:
        raise AssertionError(f"the engine produced {got} tokens where {want} were asked")
    return seconds, profile


def mixed_steps(engine: Engine, ran: list[StepStats]) -> dict:
    """The steps with prefill among `ran`: how many, their mean tokens, decode rows and token bucket (padding)."""
    mixed = [step for step in ran if step.num_prefill_tokens]
    if not mixed:
        return dict(steps=0)
    buckets = [next(b for b in engine.runner.token_buckets if b >= step.num_tokens) for step in mixed]
    return dict(steps=len(mixed), tokens=statistics.mean(step.num_tokens for step in mixed),
                decode_rows=statistics.mean(step.num_decode_seqs for step in mixed), bucket=statistics.mean(buckets))


def timed_max_tokens(requests: list[BenchRequest], tokens: int, num_decode_steps: int, max_num_batched_tokens: int
                     ) -> int:
    """What each request of a timed wave asks for: `tokens`, one more for each step the wave's prefill may take (a
    request admitted first decodes through it), and a multi-step call's more, so that no call in
    `steady_decode_s`'s window ends a request."""
    prefill_steps = -(-sum(len(r.prompt) for r in requests) // max_num_batched_tokens) + 1
    return tokens + prefill_steps + num_decode_steps


def timed_wave(engine: Engine, requests: list[BenchRequest], tokens: int, decoding: Decoding
               ) -> tuple[float, float, float, dict[str, list[float]]]:
    """Sends the requests at once; returns (TTFT: until every one has its first token, TPOT: the mean over
    requests of (the `tokens`-th token's arrival - the first's) / (tokens - 1), decode TPOT: `steady_decode_s`
    over `tokens` - 1 decode tokens, and the first and last requests' token arrivals in ms after the sending,
    to read the calls' rhythm from)."""
    max_tokens = timed_max_tokens(requests, tokens, engine.config.num_decode_steps,
                                  engine.config.max_num_batched_tokens)
    sinks = [ArrivalTimes() for _ in requests]
    start = time.perf_counter()
    for i, (request, sink) in enumerate(zip(requests, sinks)):
        engine.submit([list(request.prompt)], decoding.params(max_tokens), sink, f"timed-{i}")
    step_ends = []
    while engine.has_work:
        engine.step()
        step_ends.append(time.perf_counter())
    if any(len(sink.times) != max_tokens for sink in sinks):
        raise AssertionError(f"the engine produced {[len(s.times) for s in sinks]} tokens where {max_tokens} were asked")
    times = [at_step_ends(sink.times, step_ends) for sink in sinks]
    ttft = max(t[0] for t in times) - start
    tpot = statistics.mean((t[tokens - 1] - t[0]) / (tokens - 1) for t in times)
    arrivals = {name: [round(1e3 * (x - start), 3) for x in t] for name, t in (("first", times[0]), ("last", times[-1]))}
    return ttft, tpot, steady_decode_s(times, tokens), arrivals


def at_step_ends(times: list[float], step_ends: list[float]) -> list[float]:
    """Each arrival moved to the end of the engine step that emitted it, so that a step's tokens arrive together
    for every request. A step calls its C requests' sinks one after another, microseconds to milliseconds apart:
    stamped so, one multi-step call's delivery was split, and `steady_decode_s`'s window, closed at the earliest
    stamp of a call, left that call's tokens out for every request stamped after it (on the H200 at C=256, a
    decode TPOT of 15.6 ms where the calls delivered 8 tokens every 94 ms)."""
    return [step_ends[bisect.bisect_left(step_ends, t)] for t in times]


def profiled_decode(engine: Engine, requests: list[BenchRequest], decode_steps: int, decoding: Decoding) -> dict:
    """Traces `decode_steps` decode steps of the requests, all running (after their prefill), with
    `bench.device_profile`: the engine's period per step against the device's busy time, by program and op
    class, and the host's work by phase (`bench.host_phases`), in milliseconds per step."""
    # On a CPU the tracer now and then records no XLA event in a window (cause not found; twice in a row in one of
    # about ten loaded runs of the suite): traced again.
    for attempt in range(4):
        profile = _traced_decode(engine, requests, decode_steps, decoding, f"profiled-{attempt}")
        if profile["busy_ms"] > 0:
            break
    return profile


def _traced_decode(engine: Engine, requests: list[BenchRequest], decode_steps: int, decoding: Decoding,
                   name: str) -> dict:
    sinks = [ArrivalTimes() for _ in requests]
    for i, (request, sink) in enumerate(zip(requests, sinks)):
        # Room for the window's tokens and the calls before and after it, each up to a multi-step call's more.
        max_tokens = decode_steps + 4 * engine.config.num_decode_steps + 4
        engine.submit([list(request.prompt)], decoding.params(max_tokens), sink, f"{name}-{i}")
    emitted = lambda: min(len(sink.times) for sink in sinks)

    def step_until(tokens: int) -> None:
        while emitted() < tokens:
            if not engine.has_work:
                raise AssertionError(f"the traced requests ended before their {tokens}th token")
            engine.step()

    step_until(2)
    with DeviceTrace() as trace:
        step_until(emitted() + 1)  # collects the call that ran while the tracer started (`DeviceTrace.window`)
        before = emitted()
        timer = PhaseTimer(engine)
        with trace.window():
            # Two calls at least, so that one is dispatched and collected in it: the call collected first was
            # dispatched before it, and a short one (a CPU's tiny model) may have run before it opened.
            step_until(before + max(decode_steps, 2 * engine.config.num_decode_steps))
        timer.close()
    steps = emitted() - before
    while engine.has_work:
        engine.step()
    return traced_profile(trace, timer, steps)


def traced_profile(trace: DeviceTrace, timer: PhaseTimer, steps: int) -> dict:
    """A traced window's device time (`bench.device_profile`) and host phases, in milliseconds per step."""
    return {**trace.summary().as_dict(steps), "host_ms": timer.per_step_ms(steps)}


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Device seconds of one decode step at batch `batch` and context `context`, and of its parts."""

    batch: int
    context: int
    step_s: float
    attention_s: float
    head_s: float
    floor_bytes: int


class DirectStep:
    """A decode step at batch x context, timed directly (module docstring): the model's step (forward, LM head,
    argmax; the pool donated), the paged attention of all layers alone, and the LM head + argmax alone, each
    jitted. `compile` may run on any thread (it lowers against shapes); `time` allocates the pool and times."""

    def __init__(self, loaded: LoadedModel, batch: int, context: int, page_size: int, backend: str):
        config, model = loaded.config, loaded.model
        self.loaded, self.batch, self.context, self.page_size = loaded, batch, context, page_size
        pages_per_seq = -(-(context + 1) // page_size)
        self.num_pages = num_pages = batch * pages_per_seq
        graphdef, self.state = nnx.split(model)
        page_table = jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, pages_per_seq)
        self.positions = jnp.full((batch,), context, jnp.int32)
        self.meta = meta = AttentionMetadata(
            slot_mapping=page_table[:, context // page_size] * page_size + context % page_size,
            kv_lens=jnp.full((batch,), context + 1, jnp.int32), page_table=page_table,
            cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32), max_q_len=1,
        )
        self.tokens = jnp.arange(batch, dtype=jnp.int32) % config.vocab_size
        sm_scale = config.softmax_scale

        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(state, kv_cache, tokens, positions, meta):
            model = nnx.merge(graphdef, state)
            attend = make_paged_attend(meta, num_pages, sm_scale=sm_scale, backend=backend)
            hidden, kv = model(tokens, positions, flat_pool(kv_cache), attend)
            return jnp.argmax(model.logits(hidden), axis=-1), tuple(x.reshape(kv_cache[0].shape) for x in kv)

        @jax.jit
        def attention_all_layers(kv_cache, q, meta):
            k_pool, v_pool = flat_pool(kv_cache)

            def layer(index, q):
                out = ragged_paged_attention(
                    q, k_pool, v_pool, meta.kv_lens, meta.page_table + index * num_pages, meta.cu_q_lens,
                    max_q_len=1, sm_scale=sm_scale, backend=backend,
                )
                return q + out

            return lax.fori_loop(0, config.num_layers, layer, q)

        @jax.jit
        def head(state, hidden):
            return jnp.argmax(nnx.merge(graphdef, state).logits(hidden), axis=-1)

        self.step, self.attention_all_layers, self.head = step, attention_all_layers, head

    def _empty_pool(self) -> KVCache:
        return empty_kv_cache(self.loaded.config, self.num_pages, self.page_size, kv_cache_dtype("auto", DTYPE))

    def compile(self) -> None:
        """Compiles the model's step, the slow one (an unrolled 8B's took 8-10 s on an H200), into jit's cache."""
        pool = jax.eval_shape(self._empty_pool)
        self.step.lower(self.state, pool, self.tokens, self.positions, self.meta).compile()

    def time(self, repeats: int) -> StepTimes:
        config, batch, context = self.loaded.config, self.batch, self.context
        pool = [self._empty_pool()]  # the step donates the pool and returns the updated one

        def one_step():
            next_tokens, pool[0] = self.step(self.state, pool[0], self.tokens, self.positions, self.meta)
            return next_tokens

        q = jnp.ones((batch, config.num_heads, config.head_dim), jnp.dtype(DTYPE))
        hidden = jnp.ones((batch, config.hidden_size), jnp.dtype(DTYPE))
        step_s = median_seconds(one_step, repeats)
        attention_s = median_seconds(lambda: self.attention_all_layers(pool[0], q, self.meta), repeats)
        head_s = median_seconds(lambda: self.head(self.state, hidden), repeats)
        kv_dtype = kv_cache_dtype("auto", DTYPE)
        floor = param_bytes(self.loaded.model) + batch * (context + 1) * kv_bytes_per_token(config, kv_dtype)
        return StepTimes(batch, context, step_s, attention_s, head_s, floor)


def compile_in_parallel(steps: list[DirectStep]) -> None:
    """Compiles the steps' programs on a thread each (XLA releases the GIL while it compiles)."""
    with ThreadPoolExecutor(len(steps), thread_name_prefix="engine-check-compile") as pool:
        list(pool.map(DirectStep.compile, steps))


def engine_level(engine: Engine, served: ServedModel, workload: list[BenchRequest],
                 sustained_requests: list[BenchRequest], sizes: Sizes, c: int, peaks: Peaks, decoding: Decoding) -> dict:
    """Throughput, TTFT and TPOT at concurrency c (module docstring). Every run gets fresh token ids with the
    workload's lengths, so none is served from a previous run's prefix cache."""
    config = served.config
    fresh = [fresh_prompts(wave, salt=1000 * c + i, vocab_size=config.vocab_size)
             for i, wave in enumerate(waves(workload, c))]
    seconds = sum(generate_checked(engine, wave, decoding) for wave in fresh)
    requests = [r for wave in fresh for r in wave]
    rolling = fresh_prompts(sustained_requests[:SUSTAINED_WAVES * c], salt=1000 * c + 500, vocab_size=config.vocab_size)
    rolling_s, rolling_profile = sustained(engine, rolling, c, decoding, traced_steps=SUSTAINED_TRACED_STEPS)

    latencies = [timed_wave(engine, fresh_prompts(workload[:c], salt=1000 * c + 900 + i, vocab_size=config.vocab_size),
                            1 + sizes.tpot_steps, decoding)
                 for i in range(sizes.latency_repeats)]
    profile = profiled_decode(engine, fresh_prompts(workload[:c], salt=1000 * c + 990, vocab_size=config.vocab_size),
                              sizes.tpot_steps, decoding)
    ttft_s, tpot_s, decode_tpot_s = (statistics.median(column) for column in list(zip(*latencies))[:3])
    prompt_lens = [len(r.prompt) for r in requests]
    output_lens = [r.output_tokens for r in requests]
    bound = workload_roofline(served, peaks, prompt_lens, output_lens, batch=c)
    rolling_prompt = sum(len(r.prompt) for r in rolling)
    rolling_output = sum(r.output_tokens for r in rolling)
    return dict(
        requests=len(requests), prompt_tokens=sum(prompt_lens), output_tokens=sum(output_lens), seconds=seconds,
        output_tok_s=sum(output_lens) / seconds, total_tok_s=(sum(prompt_lens) + sum(output_lens)) / seconds,
        ttft_s=ttft_s, tpot_s=tpot_s, decode_tpot_s=decode_tpot_s, arrivals_ms=latencies[0][3],
        roofline_output_tok_s=bound.bound_output_tps,
        sustained=dict(requests=len(rolling), prompt_tokens=rolling_prompt, output_tokens=rolling_output,
                       seconds=rolling_s, output_tok_s=rolling_output / rolling_s,
                       total_tok_s=(rolling_prompt + rolling_output) / rolling_s, profile=rolling_profile),
        profile=profile,
    )


def run(args) -> dict:
    sizes = Sizes.small() if args.small else Sizes()
    if args.concurrency:
        sizes = dataclasses.replace(sizes, concurrency=tuple(args.concurrency))
    if args.max_num_batched_tokens:
        sizes = dataclasses.replace(sizes, max_num_batched_tokens=args.max_num_batched_tokens)
    peaks = Peaks.load(args.peaks)
    decoding = Decoding(args.temperature, args.top_p)
    result: dict = dict(model=args.model, dtype=DTYPE, quantization=args.quantization,
                        decoding=dataclasses.asdict(decoding),
                        backend=resolve_backend(args.attention_backend),
                        device=str(jax.devices()[0]),
                        sizes=dataclasses.asdict(sizes), levels=[])

    def save() -> None:
        result["http_stack_imported"] = sorted({"starlette", "uvicorn", "app"} & set(sys.modules))
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")

    if (shortfall := memory_shortfall(MODELS[args.model])) is not None:
        result["skipped"] = shortfall
        save()
        return result
    start = time.perf_counter()
    loaded = random_model(args.model, args.quantization)
    # The direct timings below run the model as the engine will (its runner would unstack it in place later).
    result["layer_loop"] = resolve_layer_loop(args.layer_loop)
    if result["layer_loop"] == "unrolled":
        loaded.model.unstack_layers()
    result.update(init_s=time.perf_counter() - start, param_bytes=param_bytes(loaded.model))
    save()
    config = loaded.config
    workload = synthetic(SyntheticSpec(num_requests=max(*sizes.concurrency, MIN_REQUESTS), seed=0, prompt=sizes.prompt,
                                       output=sizes.output, vocab_size=config.vocab_size))
    sustained_requests = sustained_workload(sizes, config.vocab_size)

    # Direct timings first: their KV pools are freed before the engine allocates its own.
    steps = [DirectStep(loaded, c, round(np.mean([len(r.prompt) for r in workload[:c]]) + sizes.tpot_steps / 2),
                        PAGE_SIZE, args.attention_backend) for c in sizes.concurrency]
    start = time.perf_counter()
    compile_in_parallel(steps)
    result["direct_compile_s"] = time.perf_counter() - start
    for c, step in zip(sizes.concurrency, steps):
        result["levels"].append(dict(concurrency=c, step=dataclasses.asdict(step.time(sizes.timing_repeats))))
        save()
        gc.collect()
    del steps

    engine_config = EngineConfig(
        dtype=DTYPE, page_size=PAGE_SIZE, max_num_seqs=max(sizes.concurrency),
        max_num_batched_tokens=sizes.max_num_batched_tokens, max_model_len=sizes.max_model_len,
        kv_cache_memory=min(kv_pool_bytes(config, workload, sustained_requests, sizes, PAGE_SIZE),
                            default_kv_cache_bytes()),
        attention_backend=args.attention_backend,
        layer_loop=args.layer_loop, sampler_branches=args.sampler_branches,
    )
    start = time.perf_counter()
    # Warm-up compiles the sampler plan of this run's requests alone (where the host decides plans, on a GPU): a
    # greedy run then spends no budget on the multi-step calls of sampling rows.
    engine = Engine(loaded, engine_config, progress=False, warm_for=[decoding.params(1)])
    result["compile_s"] = time.perf_counter() - start
    save()

    served = ServedModel(config, StepCost.of(config, loaded.model, DTYPE).weight_bytes, DTYPE, DTYPE)
    result["kv_cache_bytes"] = engine_config.kv_cache_memory
    for level, c in zip(result["levels"], sizes.concurrency):
        compiled, compiled_off_thread = engine.runner.num_compiled(), engine.runner.num_compiled_off_thread
        level.update(engine_level(engine, served, workload, sustained_requests, sizes, c, peaks, decoding))
        # Programs compiled while this level ran: on the engine thread, each stalled the steps (its time is in the
        # figures); off it, a plan not compiled at warm-up, whose steps ran single meanwhile.
        level["compiled"] = engine.runner.num_compiled() - compiled
        level["compiled_off_thread"] = engine.runner.num_compiled_off_thread - compiled_off_thread
        result["num_preemptions"] = engine.stats.num_preemptions
        save()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.engine_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), required=True)
    parser.add_argument("--peaks", type=Path, required=True, help="peaks JSON (python -m sluice.bench.roofline --save)")
    parser.add_argument("--out", type=Path, required=True, help="results JSON, rewritten after each stage")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--layer-loop", default="auto", choices=LAYER_LOOPS)
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                        help="the random weights stored so (int8: whether weight-only int8 pays on this device)")
    parser.add_argument("--sampler-branches", default="auto", choices=SAMPLER_BRANCHES)
    parser.add_argument("--small", action="store_true", help="CPU sizes: concurrency 1 and 4, short requests")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature instead of greedily (the sampler's passes then run too)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the nucleus sampled from")
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help="these levels instead (the pool is capped by the free memory, so a wave that outgrows "
                             "it preempts)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="the engine's tokens per step instead of a server's default on an 80 GB GPU, 8192")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
