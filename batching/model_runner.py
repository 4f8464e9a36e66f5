"""Turns a scheduled batch into padded device arrays and runs one step on the device (`device_step.py`).

Every step is padded to a bucket from a small fixed set, so after the warm-up compiles them all the step never
recompiles: decode-only steps by their number of sequences, mixed steps by their number of tokens. The KV pool
is donated to the step and replaced by its output; the model parameters are split from the NNX module once and
passed in as a flat list. Page tables and sampling parameters stay on the device (`input_batch.py`). `dispatch`
returns at once (async dispatch) and starts copying the sampled tokens to the host (`step_output.py`), so the
engine does its text work while the device computes.

A single step is two jitted calls, the model (to logits) and the sampler, so that the host fills the
structured-output masks of the step's constrained rows (`batching/structured.py`) while the device runs the
model: the masks need the tokens of the step before, which are known only at dispatch. A step with a constrained
row makes a third call between the two, which applies the masks (all-ones rows for its other rows); a step
without one makes none. A decode-only step of sequences without constraints may instead be one multi-step call,
model and sampler in one program. Where the host decides the sampler's plans, a plan met after warm-up compiles
off the engine thread (`background_compile.py`); until it is ready, a multi-step call of it runs as single
steps, and a single step samples with every pass (the same tokens).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, replace
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
from flax import nnx
from tqdm import tqdm

from sluice.batching import step_broadcast
from sluice.batching.background_compile import BackgroundCompiler, shapes_of
from sluice.batching.device_step import Bucket, DraftState, PromptScores, StepInputs, VerifiedSteps, decode_steps, \
    forward, pack, packed_step, sample_step, score_step, verify_steps, write_packed
from sluice.batching.faults import Fault
from sluice.batching.ngram import NgramConfig
from sluice.batching.request import MAX_STOP_IDS
from sluice.batching.input_batch import InputBatch, SlotWrites
from sluice.batching.kv_store import PagePayload
from sluice.batching.kv_transfer import PageCopy, load_pages
from sluice.batching.sampler import EVERY_PASS, SampledRows, SamplerOutput, SamplerPlan, SamplingBatch, \
    bitmask_words, mask_disallowed, resolve_sampler_branches
from sluice.batching.scheduler import ScheduledChunk, scored_rows
from sluice.batching.sequence import PENDING, SequenceStatus
from sluice.batching.step_output import PendingStep
from sluice.batching.structured import fill_bitmask
from sluice.model.llama import LORA_PARAMS, Llama, empty_kv_cache, resolve_layer_loop
from sluice.sharding.rules import kv_cache_sharding, replicated

logger = logging.getLogger(__name__)

# Prefill chunks reach attention as pieces of at most this many queries: the attention pads every row to
# max_q_len, so short pieces keep the decode rows sharing a mixed step cheap, and the set of shapes small.
PREFILL_PIECE = 16
# Mixed steps of more tokens than this are compute-bound on every device: their buckets grow by quarter octaves,
# not doublings, so padding costs at most a fifth of a step, not up to half (`token_buckets`).
FINE_TOKEN_BUCKETS_ABOVE = 512
# Threads that compile the step programs at warm-up (each compile holds a few GB of host memory for a large model).
WARMUP_THREADS = 8


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo, capped by hi, with hi itself last."""
    out, b = [], 1
    while b < hi:
        if b >= lo:
            out.append(b)
        b *= 2
    return out + [hi]


def token_buckets(lo: int, hi: int) -> list[int]:
    """A mixed step's token counts: powers of two from lo up to FINE_TOKEN_BUCKETS_ABOVE, then quarter octaves (x
    5/4, 3/2, 7/4, 2 of each power of two), capped by hi, with hi itself last. In a sustained stream of prompts on
    an H200, Llama-3-8B's mixed steps at 1,024 sequences were compute-bound (matmuls 70% of them), and of about
    3,000 tokens by the workload's arithmetic: doublings ran them as 4,096 (2026-11-30, bench/RESULTS.md)."""
    coarse = pow2_buckets(lo, min(hi, FINE_TOKEN_BUCKETS_ABOVE))
    octave, fine = FINE_TOKEN_BUCKETS_ABOVE, []
    while octave < hi:
        fine += [octave * q // 4 for q in (5, 6, 7, 8) if octave * q // 4 < hi]
        octave *= 2
    return coarse + fine + ([hi] if coarse[-1] < hi else [])


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items in groups of `counts[i]` items, in order: each item's group, and its index within the group."""
    group = np.repeat(np.arange(len(counts)), counts)
    return group, np.arange(len(group)) - (np.cumsum(counts) - counts)[group]


def write_slot(stacked: tuple[bool, ...], leaves: list[jax.Array], rows: list[jax.Array], index: jax.Array
               ) -> list[jax.Array]:
    """Each of `leaves` with `rows[i]` at `index` of its slot axis: 1 where `stacked[i]` (`[L, S, ...]`, a row
    `[L, ...]`), else 0 (one layer's `[S, ...]`, a row `[...]`); an `index` past the slots writes nothing."""
    return [leaf.at[:, index].set(row, mode="drop") if whole else leaf.at[index].set(row, mode="drop")
            for whole, leaf, row in zip(stacked, leaves, rows)]


class ModelRunner:
    """Owns the KV pool and the compiled step for one model."""

    def __init__(self, model: Llama, *, num_pages: int, page_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, num_decode_steps: int = 1, ngram: NgramConfig | None = None,
                 attention_backend: str = "auto", kv_dtype: jnp.dtype | None = None, mesh: Mesh | None = None,
                 layer_loop: str = "auto", sampler_branches: str = "auto"):
        """`mesh`: tensor-parallel mesh the model's params are sharded on; the KV pool is then split over KV heads.
        `kv_dtype`: the pool's dtype (`kv_cache.kv_cache_dtype`); None: the model's activation dtype.
        `num_decode_steps` > 1 also compiles multi-step decode calls of that many steps;
        `ngram` (speculative decoding) also compiles mixed steps that sample every draft position, and with
        multi-step decode, multi-step calls that propose and check drafts on the device.
        `layer_loop` (`model.llama.LAYER_LOOPS`): "unrolled" stores the model's layers one array each (in place).
        `sampler_branches` (`sampler.SAMPLER_BRANCHES`): "host" decides each step's `SamplerPlan` at dispatch, and
        compiles a sampler (and a multi-step call) per plan met, the plans of greedy and of plain sampling rows at
        warm-up; a multi-process job leaves it to the device (the steps it broadcasts carry no plan)."""
        self.config = model.config
        self.mesh = mesh
        self.kv_sharding = (
            kv_cache_sharding(mesh) if mesh is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )
        self.page_size = page_size
        self.max_model_len = max_model_len
        if resolve_layer_loop(layer_loop) == "unrolled":
            model.unstack_layers()
        self.graphdef, self.state = nnx.split(model)
        self.weights, self._state_def = jax.tree.flatten(self.state)
        # The LoRA slots' leaves (`model.lora`): (index in `weights`, parameter, layer: None for a stack).
        self._lora = [(i, path[0].key, path[-1].idx if isinstance(path[-1], jax.tree_util.SequenceKey) else None)
                      for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(self.state)[0])
                      if path[0].key in LORA_PARAMS]
        self._write_lora = jax.jit(partial(write_slot, tuple(layer is None for _, _, layer in self._lora)),
                                   donate_argnums=(0,),
                                   out_shardings=[self.weights[i].sharding for i, _, _ in self._lora])
        self.num_pages = num_pages
        # The pool's pages per layer: the block manager's, then the null page no page table holds, where a lone
        # padding token's K/V go (`kv_cache.write_kv`: a one-row step writes without reading the row it replaces).
        self.pool_pages = num_pages + 1
        self.kv_dtype = jnp.dtype(model.dtype if kv_dtype is None else kv_dtype)
        self.backend = attention_backend
        self.max_num_seqs = max_num_seqs
        self.decode_buckets = pow2_buckets(1, min(max_num_seqs, max_num_batched_tokens))
        self.token_buckets = token_buckets(PREFILL_PIECE, max_num_batched_tokens)
        self.num_decode_steps = num_decode_steps
        self.ngram = ngram
        self.num_speculative_tokens = ngram.num_speculative_tokens if ngram else 0
        # Verify steps are of at most ngram.max_batch_size decoding sequences, 1 + k tokens each.
        max_verified = min(self.decode_buckets[-1], ngram.max_batch_size) if ngram else 0
        self.spec_token_buckets = (
            pow2_buckets(2, min(max_num_batched_tokens, max_verified * (1 + self.num_speculative_tokens))) if ngram
            else [])
        self.verify_buckets = pow2_buckets(1, max_verified) if ngram and num_decode_steps > 1 else []
        self._steps: dict[tuple[int, int, SamplerPlan | None], jax.stages.Wrapped] = {}  # `_step_fn`'s
        self.plans_on_host = (resolve_sampler_branches(sampler_branches) == "host"
                              and not step_broadcast.is_multiprocess())
        # Logits and sampled tokens replicated on every device, so any process (process 0 in a multi-process job)
        # reads the tokens.
        everywhere = None if mesh is None else replicated(mesh)
        # partial: jax.jit keys its cache by the function object, and this runner's compilations are its own.
        self._sample = jax.jit(partial(sample_step, max_num_seqs), static_argnums=(0,), out_shardings=everywhere)
        self._mask = jax.jit(partial(mask_disallowed), out_shardings=everywhere)
        self._score = jax.jit(partial(score_step, self.graphdef, self._state_def), out_shardings=everywhere)
        self._step_outputs_sharding = everywhere or self.kv_sharding
        self.reset()
        self._write_slots = jax.jit(partial(write_packed), static_argnums=(0,), donate_argnums=(1,),
                                    out_shardings=everywhere)
        self._no_histories: dict[int, jax.Array] = {}
        # Host plans: the multi-step calls, (bucket, plan), and samplers, (rows, plan), compiled on this thread
        # (at warm-up); the others compile on a thread of their own (`background_compile.py`).
        self._jitted: set[tuple] = set()
        self._compiler = BackgroundCompiler()
        self.fault = Fault.from_env()
        self._num_dispatched = 0

    @property
    def buckets(self) -> list[Bucket]:
        steps_per_call = sorted({1, self.num_decode_steps})
        return ([self._decode_bucket(s, k) for k in steps_per_call for s in self.decode_buckets]
                + [self._verify_bucket(s) for s in self.verify_buckets]
                + [self._mixed_bucket(t, False) for t in self.token_buckets]
                + [self._mixed_bucket(t, True) for t in self.spec_token_buckets])

    def _decode_bucket(self, num_seqs: int, num_steps: int = 1) -> Bucket:
        return Bucket(num_seqs, num_seqs, num_seqs, 1, num_steps)

    def _verify_bucket(self, num_seqs: int) -> Bucket:
        return Bucket(num_seqs, num_seqs, num_seqs, 1 + self.num_speculative_tokens, self.num_decode_steps)

    def _mixed_bucket(self, num_tokens: int, speculative: bool) -> Bucket:
        # The most prefill pieces: as many chunks as may run, each a piece's worth of tokens past whole pieces
        # (a chunk of n tokens is ceil(n / PREFILL_PIECE) pieces). A speculative step samples every draft
        # position of its decoding sequences, not one row per sequence.
        seqs = min(self.max_num_seqs, num_tokens)
        rows = min(num_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens)) if speculative else seqs
        return Bucket(num_tokens, seqs + (num_tokens - seqs) // PREFILL_PIECE, rows, PREFILL_PIECE)

    def bucket_for(self, chunks: list[ScheduledChunk], num_steps: int = 1, verifies: bool = False,
                   scores: bool = False) -> Bucket:
        """The compiled shape that runs `chunks`; `scores`: a chunk scores prompt tokens, which needs the hidden
        states only a mixed step returns (a prompt chunk of one token would otherwise run decode-shaped)."""
        num_tokens = sum(c.num_tokens for c in chunks)
        if verifies:
            return self._verify_bucket(next(b for b in self.verify_buckets if b >= len(chunks)))
        if max(c.num_tokens for c in chunks) == 1 and not scores:
            return self._decode_bucket(next(b for b in self.decode_buckets if b >= len(chunks)), num_steps)
        speculative = any(c.num_drafts for c in chunks)
        buckets = self.spec_token_buckets if speculative else self.token_buckets
        return self._mixed_bucket(next(b for b in buckets if b >= num_tokens), speculative)

    def _step_fn(self, bucket: Bucket, plan: SamplerPlan | None = None):
        """The model of a single step (to logits), or a whole multi-step decode call (its sampler's `plan`)."""
        key = (bucket.max_q_len, bucket.num_steps, plan if bucket.num_steps > 1 else None)
        if key not in self._steps:
            out_shardings = None if self.mesh is None else (replicated(self.mesh), self.kv_sharding)
            args = (self.graphdef, self.backend, self.mesh, self.pool_pages)
            if bucket.verifies:
                fn = partial(verify_steps, *args, self.page_size, self.ngram, bucket.num_steps, self.max_num_seqs,
                             plan)
            elif bucket.num_steps > 1:
                fn = partial(decode_steps, *args, self.page_size, bucket.num_steps, self.max_num_seqs, plan)
            else:
                fn = partial(forward, *args, bucket.max_q_len)
            self._steps[key] = jax.jit(packed_step(fn, self._state_def), static_argnums=(0,), donate_argnums=(2,),
                                       out_shardings=out_shardings)
        return self._steps[key]

    def _run(self, bucket: Bucket, writes: SlotWrites | None, inputs: StepInputs, sampled: SampledRows,
             fill_masks: Callable[[np.ndarray], None] | None = None, poison: bool = False,
             plan: SamplerPlan | None = None, scores: bool = False, masks_later: bool = False
             ) -> tuple[SamplerOutput | VerifiedSteps | Callable[[], SamplerOutput], jax.Array | None,
                        PromptScores | None]:
        """Writes the changed slots, launches the step on host inputs (numpy) and replaces the pool; returns
        without waiting, with a single step's pooled rows and, with `scores`, its `PromptScores` (`score_step`).

        `fill_masks(allowed)`, for a single step with constrained rows, writes their masks into `allowed`
        ([num_rows, ceil(V / 32)] int32, all ones) while the model runs; with `masks_later`, not yet: the call
        that fills them and samples is returned instead of its output. `poison`: the first row's logits become
        NaN (an injected fault). `plan`: the sampler's, when the host decides it.
        """
        if writes is not None:
            self._write(writes)
        flat, packing = pack((inputs, replace(sampled, history=None)))
        program = self._compiler.get((bucket, plan)) if bucket.num_steps > 1 and plan is not None else None
        result, self.kv_cache = (program or partial(self._step_fn(bucket, plan), packing))(
            self.weights, self.kv_cache, self._last_tokens, self._slots, self._global(flat),
            self._global(sampled.history))
        if bucket.num_steps > 1:
            out, self._last_tokens = result
            return out, None, None
        logits, sampling, pooled, hidden = result
        scored = self._score(self.weights, hidden, self._global(inputs.score_ids)) if scores else None
        if poison:
            logits = logits.at[0].set(jnp.nan)

        def sample() -> SamplerOutput:
            masked = logits
            if fill_masks is not None:
                allowed = np.full((bucket.num_rows, bitmask_words(self.config.vocab_size)), -1, np.int32)
                fill_masks(allowed)
                masked = self._mask(logits, self._global(allowed))
            out, self._last_tokens = self._sampler_for(bucket.num_rows, plan, masked, sampling)(masked, sampling)
            return out

        return (sample if masks_later and fill_masks is not None else sample()), pooled, scored

    def _sampler_for(self, num_rows: int, plan: SamplerPlan | None, logits: jax.Array, sampling: SamplingBatch
                 ) -> Callable[[jax.Array, SamplingBatch], tuple[SamplerOutput, jax.Array]]:
        """A single step's sampler for `plan`: compiled here (at warm-up) or off this thread; until then, the
        sampler of every pass, which gives the same outputs (its top alternatives and acceptances are read only
        when the plan has them)."""
        key = (num_rows, plan)
        if plan is None or key in self._jitted:
            return partial(self._sample, plan)
        if (program := self._compiler.get(key)) is not None:
            return program
        if key not in self._compiler:
            self._compiler.submit(key, partial(self._sample.lower, plan, *shapes_of((logits, sampling))))
        self._jitted.add((num_rows, EVERY_PASS))  # warmed, or compiled now, once per row count
        return partial(self._sample, EVERY_PASS)

    def _call_ready(self, bucket: Bucket, plan: SamplerPlan) -> bool:
        """Whether the multi-step call of `bucket` is compiled for `plan`; if not, it compiles off this thread."""
        key = (bucket, plan)
        if key in self._jitted or self._compiler.get(key) is not None:
            return True
        if key not in self._compiler:
            self._compiler.submit(key, self._lowering(bucket, plan))
        return False

    def _lowering(self, bucket: Bucket, plan: SamplerPlan | None) -> Callable[[], jax.stages.Lowered]:
        """Lowers `bucket`'s program for `plan` when called, on any thread: against the shapes of the arrays a step
        passes, never the arrays (a step may donate them meanwhile)."""
        inputs, sampled = self._pad([], bucket, None)
        flat, packing = pack((inputs, replace(sampled, history=None)))
        shapes = shapes_of((self.weights, self.kv_cache, self._last_tokens, self._slots, flat, sampled.history))
        return partial(self._step_fn(bucket, plan).lower, packing, *shapes)

    def _write(self, writes: SlotWrites) -> None:
        flat, packing = pack((writes.slots, writes.rows))
        self._slots = self._write_slots(packing, self._slots, self._global(flat))

    def _history(self, history: np.ndarray | None, num_rows: int) -> np.ndarray | jax.Array:
        """A step's token histories ([num_rows, max_model_len] int32) on the device, uncommitted (so the step
        compiles the same whichever it gets); None: all -1, kept on the device per row count. A multi-process
        job sends them as host arrays."""
        if step_broadcast.is_multiprocess():
            return np.full((num_rows, self.max_model_len), -1, np.int32) if history is None else history
        if history is not None:
            return jax.device_put(history)
        if num_rows not in self._no_histories:
            self._no_histories[num_rows] = jax.device_put(np.full((num_rows, self.max_model_len), -1, np.int32))
        return self._no_histories[num_rows]

    def _global(self, tree):
        """A computation spanning processes takes global arrays: each process holds the same full copy."""
        if not step_broadcast.is_multiprocess():
            return tree
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated(self.mesh), x), tree)

    def reset(self) -> None:
        """What steps update, as at start (no sequence holds a slot or a page then): a zeroed pool, committed to
        its devices (so the first step compiles the same as later ones), empty slots, and the last step's sampled
        tokens (each sequence's at its row, for the next step to feed: `StepInputs.feed`). After a failed step,
        all of them are suspect."""
        self.kv_cache = empty_kv_cache(self.config, self.pool_pages, self.page_size, self.kv_dtype, self.kv_sharding)
        max_pages = -(-self.max_model_len // self.page_size)
        self.input_batch = InputBatch(self.max_num_seqs, max_pages, self.config.vocab_size, MAX_STOP_IDS,
                                      pow2_buckets(1, self.max_num_seqs))
        self._slots = jax.device_put(self.input_batch.host, self._step_outputs_sharding)
        self._last_tokens = jax.device_put(np.zeros(self.max_num_seqs, np.int32), self._step_outputs_sharding)
        self._last_row = np.full(self.max_num_seqs + 1, -1, np.int32)  # by slot: its token's row in `_last_tokens`

    def write_layer_rows(self, rows: Mapping[str, np.ndarray], index: int) -> None:
        """Writes LoRA slot `index` (`model.lora`): `rows[name]` `[L, ...]` at `index` of the axis after the layers
        of each LoRA parameter `name` (`[L, S, ...]`, stored as a stack or one array per layer), in place (one
        program, compiled at warm-up, the arrays donated) after the steps dispatched before, which read the old
        weights. ValueError unless `rows` holds every LoRA parameter, in its shape. An index past the slots writes
        nothing."""
        shapes = {name: row.shape for name, row in self._lora_rows().items()}
        if bad := sorted(name for name in shapes.keys() | rows.keys() if np.shape(rows.get(name)) != shapes.get(name)):
            raise ValueError(f"a LoRA slot's rows must hold every LoRA parameter in its shape: not {', '.join(bad)}")
        parts = [rows[name] if layer is None else rows[name][layer] for _, name, layer in self._lora]
        leaves = [self.weights[i] for i, _, _ in self._lora]
        written = self._write_lora(leaves, *self._global((parts, np.int32(index))))
        weights = list(self.weights)
        for (i, _, _), leaf in zip(self._lora, written):
            weights[i] = leaf
        self.weights = weights
        self.state = jax.tree.unflatten(self._state_def, weights)

    def _lora_rows(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One LoRA slot's part of each LoRA parameter, `[L, ...]` (`write_layer_rows`' rows)."""
        return {name: jax.ShapeDtypeStruct((self.config.num_layers, *self.weights[i].shape[2 if layer is None else 1:]),
                                           self.weights[i].dtype) for i, name, layer in self._lora}

    def load_pages(self, pages: list[int], payloads: list[PagePayload]) -> None:
        """Writes stored pages' K/V into `pages` of the pool, ordered after the steps already dispatched."""
        self.kv_cache = load_pages(self.kv_cache, pages, payloads)

    def copy_out(self, pages: list[int]) -> PageCopy:
        """Starts copying `pages` of the pool to the host, after the steps already dispatched."""
        return PageCopy(self.kv_cache, pages)

    def num_compiled(self) -> int:
        """Programs compiled on the engine thread: models (one per bucket), samplers and masks (one each per bucket
        row count), slot writes (one per count of rows written) and LoRA slot writes (one); not the small scoring
        programs (`score_step`), compiled when prompt logprobs are first asked for."""
        return (sum(fn._cache_size() for fn in self._steps.values()) + self._sample._cache_size()
                + self._mask._cache_size() + self._write_slots._cache_size() + self._write_lora._cache_size())

    @property
    def num_compiled_off_thread(self) -> int:
        """Programs compiled off the engine thread (`background_compile.py`)."""
        return self._compiler.num_compiled

    def wait_for_compiles(self) -> None:
        """Blocks until the programs queued off the engine thread are compiled (a benchmark's or a test's warm-up)."""
        self._compiler.wait()

    def warmup(self, progress: bool = True, plans: list[SamplerPlan] | None = None) -> None:
        """Compiles every bucket, with its masks (an all-padding step writes nothing to the pool), for each of
        `plans` when the host decides them (default: those of greedy and of plain sampling rows), with a single
        step's sampler of every pass (which stands in for a plan met later while that one compiles), and every
        size of slot writes (padding writes change nothing), and the LoRA slot write."""
        for size in self.input_batch.buckets:
            self._write(self.input_batch.slot_writes([], size))
        if self._lora:  # into a slot past the last
            i, _, layer = self._lora[0]
            self.write_layer_rows({name: np.zeros(row.shape, row.dtype) for name, row in self._lora_rows().items()},
                                  self.weights[i].shape[1 if layer is None else 0])
        if not self.plans_on_host:
            plans = [None]
        elif plans is None:
            plans = [SamplerPlan(), SamplerPlan(sampling=True)]
        calls = [(bucket, plan) for bucket in self.buckets
                 for plan in plans + ([EVERY_PASS] if self.plans_on_host and bucket.num_steps == 1 else [])]
        self._compile_models(calls, progress)
        for bucket, plan in calls:
            self._jitted.add((bucket, plan) if bucket.num_steps > 1 else (bucket.num_rows, plan))
            self._run(bucket, None, *self._pad([], bucket, None), fill_masks=lambda allowed: None, plan=plan)
        jax.block_until_ready((self.kv_cache, self._slots))

    def _compile_models(self, calls: list[tuple[Bucket, SamplerPlan | None]], progress: bool) -> None:
        """Compiles the model programs of `calls` (a single step's is one for every plan) on up to WARMUP_THREADS
        threads: XLA releases the GIL while it compiles, and an 8B model's unrolled layers took 8-10 s a program on
        an H200. The calls then find them in jit's cache. A multi-process job compiles as it calls (its steps take
        global arrays), and so does every program left when one fails here (the call then raises, if it must)."""
        if step_broadcast.is_multiprocess():
            return
        programs = {}
        for bucket, plan in calls:
            key = (bucket, plan if bucket.num_steps > 1 else None)
            if key not in programs:
                programs[key] = self._lowering(bucket, plan)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = min(WARMUP_THREADS, cores)
        pool = ThreadPoolExecutor(threads, thread_name_prefix="sluice-warmup")
        try:
            compiled = pool.map(lambda lowering: lowering().compile(), programs.values())
            for _ in tqdm(compiled, total=len(programs), desc="Compiling step buckets", disable=not progress):
                pass
        except Exception as error:  # noqa: BLE001 - warm-up's calls compile what is left, one at a time
            logger.warning("compiling the step programs on %d threads failed (%s: %s); compiling one at a time",
                           threads, type(error).__name__, error)
        finally:
            pool.shutdown(cancel_futures=True)

    def dispatch(self, chunks: list[ScheduledChunk], limits: list[int] | None = None,
                 drafting: list[int] | None = None, pooling: bool = False, scoring: bool = False,
                 masks_later: bool = False) -> PendingStep:
        """Runs one step for `chunks` (row i of the sampler output belongs to chunks[i]) without waiting.

        `limits`: for a decode-only step, run `num_decode_steps` decode steps in this call, chunk i emitting at
        most limits[i] tokens (its pages must hold them). `drafting` (with limits): the most drafts each chunk
        checks at a step of that call (0: none), proposing and checking them on the device (`verify_steps`: the
        result is `VerifiedSteps`).
        Outputs have a leading [num_steps] axis either way. Sequences with a grammar get their masks (one per
        sampled row, drafts included) while the model runs, in a single step (a multi-step call draws theirs
        unmasked, for the engine to check); with `masks_later` (a single step dispatched before the host has the
        tokens of the step before it), only when the engine has taken those in and calls `PendingStep.sample`:
        the sequences that step ended keep all-ones rows (theirs are dropped).
        `pooling`: fetch the pooled rows (`StepOutput.pooled`).
        `scoring`: some sequence may score its prompt (`SamplingParams.prompt_logprobs`); a step with prompt tokens
        to score runs the scoring program after it (`StepOutput.scores`; compiled when first met, a small one).
        A multi-step call not compiled for its sampler's plan runs as a single step while it compiles off this
        thread: the returned step's `limits` and `drafting` say what ran.
        """
        writes = self.input_batch.writes([c.seq for c in chunks])
        drafted = any(c.num_drafts for c in chunks)
        plan = self._plan(chunks)
        if limits is not None and plan is not None and not self._call_ready(
                self.bucket_for(chunks, self.num_decode_steps, drafting is not None), plan):
            limits = drafting = None
        num_steps = self.num_decode_steps if limits is not None else 1
        verifies = drafting is not None
        scores = scoring and any(c.num_scored for c in chunks)
        bucket = self.bucket_for(chunks, num_steps, verifies, scores)
        inputs, sampled = self._pad(chunks, bucket, limits, drafting)
        if pooling:
            self._fill_pooling(chunks, inputs)
        if scores:
            self._fill_scores(chunks, inputs)
        # Each chunk's first sampled row: a chunk with drafts samples one row per draft position, and one more.
        rows = ([i * bucket.max_q_len for i in range(len(chunks))] if verifies
                else list(itertools.accumulate((1 + c.num_drafts for c in chunks[:-1]), initial=0)))
        # Where each slot's last token is in `last_tokens`, for the next step (unknown after drafts).
        self._last_row.fill(-1)
        if not drafted:
            sampling = [i for i, c in enumerate(chunks) if c.sample]
            self._last_row[sampled.slot[sampling]] = sampling  # no chunk drafts: row i is chunk i's
        constrained = [(c.seq, row, c.seq.drafts[:c.num_drafts])
                       for c, row in zip(chunks, rows) if c.sample and c.seq.grammar is not None and num_steps == 1]
        if step_broadcast.is_multiprocess():
            num_writes = 0 if writes is None else len(writes.slots)
            step_broadcast.send_step((*astuple(bucket), bool(constrained), num_writes, scores), (inputs, sampled))
            if writes is not None:
                step_broadcast.send_payload((writes.slots, writes.rows))

        def fill_masks(allowed: np.ndarray) -> None:
            if live := [(seq.grammar, row, drafts) for seq, row, drafts in constrained
                        if seq.status is SequenceStatus.RUNNING]:
                fill_bitmask(live, allowed)
            if step_broadcast.is_multiprocess():
                step_broadcast.send_payload(allowed)

        self._num_dispatched += 1
        # "nan" poisons row 0: it strikes the first single step whose first chunk samples, not one that would
        # ignore it (a prefill chunk's).
        fault = (self.fault.fires(self._num_dispatched, num_steps == 1 and chunks[0].sample)
                 if self.fault is not None else None)
        out, pooled, scored = self._run(bucket, writes, inputs, sampled, fill_masks if constrained else None,
                                        fault == "nan", plan, scores, masks_later)
        return PendingStep(out, chunks, rows, limits, drafting, pooled if pooling else None, scored, bucket, fault)

    def _plan(self, chunks: list[ScheduledChunk]) -> SamplerPlan | None:
        """The sampler's passes the chunks' rows need, when the host decides them; their slots' rows must be
        current."""
        if not self.plans_on_host:
            return None
        slots = np.array([c.seq.slot for c in chunks], np.int32)
        return SamplerPlan.of(self.input_batch.host.sampling, slots)

    def follow(self) -> None:
        """Processes other than 0 of a multi-process job: runs the steps process 0 sends until it stops."""
        while (header := step_broadcast.receive_step_shape()) is not None:
            *shape, masked, num_writes, scores = header
            bucket = Bucket(*shape)
            inputs, sampled = step_broadcast.receive_payload(self._pad([], bucket, None))
            writes = None
            if num_writes:
                template = self.input_batch.slot_writes([], num_writes)
                writes = SlotWrites(*step_broadcast.receive_payload((template.slots, template.rows)))

            def receive_masks(allowed: np.ndarray) -> None:
                np.copyto(allowed, step_broadcast.receive_payload(allowed))

            try:
                jax.block_until_ready(self._run(bucket, writes, inputs, sampled, receive_masks if masked else None,
                                                scores=bool(scores)))
            except Exception:  # noqa: BLE001 - process 0 fails the same step and starts over; so do we
                self.reset()

    def stop_followers(self) -> None:
        """Process 0 of a multi-process job: ends the other processes' `follow` (no-op otherwise)."""
        if step_broadcast.is_multiprocess() and step_broadcast.is_leader():
            step_broadcast.send_stop()

    def _pad(self, chunks: list[ScheduledChunk], bucket: Bucket, limits: list[int] | None,
             drafting: list[int] | None = None) -> tuple[StepInputs, SampledRows]:
        """The step's per-token and per-row arrays (numpy), padded to `bucket`; page tables and sampling
        parameters are the slots' (`input_batch`), whose host rows must be current for `chunks`. Python gathers
        one list per field (a comprehension each); numpy derives the rest, so a decode step of hundreds of
        sequences costs no Python loop per sequence."""
        t, a, num_rows = bucket.num_tokens, bucket.num_attn_seqs, bucket.num_rows
        draft_state = DraftState(np.full((num_rows, self.max_model_len if bucket.verifies else 0), -1, np.int32),
                                 np.zeros(num_rows, np.int32))
        for i, (chunk, max_drafts) in enumerate(zip(chunks, drafting or [])):
            if max_drafts:
                draft_state.history[i, :chunk.seq.num_tokens] = chunk.seq.token_ids
                draft_state.max_drafts[i] = max_drafts
        padding_slot = self.input_batch.padding_slot
        inputs = StepInputs(
            token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), slot_mapping=np.full(t, -1, np.int32),
            kv_lens=np.zeros(a, np.int32), attn_slots=np.full(a, padding_slot, np.int32),
            cu_q_lens=np.zeros(a + 1, np.int32), logits_rows=np.zeros(num_rows, np.int32),
            limits=np.zeros(num_rows, np.int32), num_sampled=np.array(0, np.int32), drafting=draft_state,
            feed=np.full(t, -1, np.int32), pool_ids=np.full(t, -1, np.int32), score_ids=np.full(t, -1, np.int32))
        inputs.limits[:len(chunks)] = limits if limits is not None else 1
        # Token histories are built only if a row's penalties read them (else an all -1 array kept on the device).
        slots = np.array([c.seq.slot for c in chunks], np.int32)
        reads_history = self.input_batch.host.sampling.penalized()[slots].any()
        history = np.full((num_rows, self.max_model_len), -1, np.int32) if reads_history else None
        sampled = SampledRows(np.full(num_rows, padding_slot, np.int32), np.zeros(num_rows, np.int32),
                              np.full(num_rows, -1, np.int32), history)
        if chunks:
            lengths = np.array([c.num_tokens for c in chunks])
            starts = np.array([c.start for c in chunks])
            self._fill_tokens(chunks, starts, lengths, slots, bucket.max_q_len, inputs)
            self._fill_rows(chunks, starts, lengths, slots, self.input_batch.host.sampling.num_prompt[slots],
                            inputs, sampled)
        return inputs, replace(sampled, history=self._history(history, num_rows))

    def _fill_tokens(self, chunks: list[ScheduledChunk], starts: np.ndarray, lengths: np.ndarray, slots: np.ndarray,
                     q: int, inputs: StepInputs) -> None:
        """Per token: id (or where the device holds it), position, pool slot; per attention row: its chunk's
        slot, kv_len and query range. A chunk's queries go in pieces of at most q; a piece's queries are the last
        of its kv_len positions, so the pieces of one chunk chain causally."""
        ends = np.cumsum(lengths)
        num = int(ends[-1])
        inputs.token_ids[:num] = ([c.seq.token_ids[c.start] for c in chunks] if num == len(chunks)  # decodes
                                  else [token for c in chunks for token in c.token_ids])
        # A sequence whose last token is the previous step's, still on the device, takes it from there.
        last = ends - 1
        pending = inputs.token_ids[last] == PENDING
        if pending.any():
            inputs.feed[last[pending]] = self._last_row[slots[pending]]
        token_chunk, offset = ragged(lengths)
        positions = inputs.positions[:num] = starts[token_chunk] + offset
        pages = self.input_batch.host.page_table[slots[token_chunk], positions // self.page_size]
        inputs.slot_mapping[:num] = pages * self.page_size + positions % self.page_size
        piece_chunk, piece = ragged(-(-lengths // q))
        piece_end = np.minimum((piece + 1) * q, lengths[piece_chunk])  # within its chunk
        inputs.attn_slots[:len(piece_chunk)] = slots[piece_chunk]
        inputs.kv_lens[:len(piece_chunk)] = starts[piece_chunk] + piece_end
        inputs.cu_q_lens[1:len(piece_chunk) + 1] = (ends - lengths)[piece_chunk] + piece_end
        inputs.cu_q_lens[len(piece_chunk) + 1:] = num

    @staticmethod
    def _fill_pooling(chunks: list[ScheduledChunk], inputs: StepInputs) -> None:
        """Chunk i's pooled tokens add to row i: all its tokens for a mean, the prompt's last for a last token."""
        for i, (chunk, end) in enumerate(zip(chunks, itertools.accumulate(c.num_tokens for c in chunks))):
            pooling = chunk.seq.params.pooling
            if pooling == "mean" or pooling == "last" and chunk.sample:
                inputs.pool_ids[end - (chunk.num_tokens if pooling == "mean" else 1):end] = i

    @staticmethod
    def _fill_scores(chunks: list[ScheduledChunk], inputs: StepInputs) -> None:
        """A chunk's scoring tokens (`ScheduledChunk.num_scored`) score the prompt's next token each."""
        for chunk, rows in scored_rows(chunks):
            inputs.score_ids[rows] = chunk.seq.prompt_ids[chunk.start + 1:chunk.start + 1 + chunk.num_scored]

    @staticmethod
    def _fill_rows(chunks: list[ScheduledChunk], starts: np.ndarray, lengths: np.ndarray, slots: np.ndarray,
                   num_prompt: np.ndarray, inputs: StepInputs, sampled: SampledRows) -> None:
        """Per sampled row: its logits row, slot, output step (the output index of the token it samples) and
        draft. A chunk with drafts has one row per draft position, each scoring the next token as if the drafts
        before it were accepted."""
        num_drafts = [c.num_drafts for c in chunks]
        num_rows = np.array(num_drafts) + 1
        row_chunk, j = ragged(num_rows)
        n = len(row_chunk)
        inputs.logits_rows[:n] = np.cumsum(lengths)[row_chunk] - num_rows[row_chunk] + j
        sampled.slot[:n] = slots[row_chunk]
        sampled.step[:n] = (starts + lengths - num_rows + 1 - num_prompt)[row_chunk] + j
        if any(num_drafts):
            sampled.draft[:n] = [d for c in chunks for d in (*c.seq.drafts[:c.num_drafts], -1)]
        inputs.num_sampled[...] = n
        if sampled.history is not None:
            for row, (chunk, k) in enumerate(zip(row_chunk.tolist(), j.tolist())):
                seq = chunks[chunk].seq
                if seq.params.reads_history:
                    seen = seq.token_ids + seq.drafts[:k]
                    sampled.history[row, :len(seen)] = seen
