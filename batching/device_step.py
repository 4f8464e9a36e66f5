"""What a step runs on the device: pure functions of (weights, KV pool, inputs), which the runner jits with the
pool donated (`model_runner.py`).

Three programs, by the step's shape (`Bucket`):
- `forward`: one step's model, to the sampled rows' logits (`sample_step` samples them, a call of its own).
- `decode_steps`: several decode steps in one call. Each sampled token is fed back on the device, rows stop on
  their stop ids there, and each row runs at most its `limit` steps (its pages are reserved for them
  beforehand). Never given constrained rows: the host cannot fill a mask between the steps.
- `verify_steps`: the same with speculative decoding. Drafting rows propose n-gram drafts on the device at every
  step and check them there, so the host is not needed between one verification and the next.

Outputs always carry a leading [num_steps] axis. A step's inputs cross to the device packed in one buffer
(`pack`), beside the persistent input batch's rows (`input_batch.py`). Each step leaves every sequence's last
sampled token on the device (`last_tokens`), and the next step takes from there the tokens the host has not seen
yet (`StepInputs.fed`): with overlapped scheduling the engine dispatches that step before it collects this one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sluice.batching.input_batch import SlotRows, write_rows
from sluice.batching.ngram import NgramConfig, propose_on_device
from sluice.batching.sampler import SampledRows, SamplerOutput, SamplerPlan, SamplingBatch, sample
from sluice.batching.sampling_params import MAX_TOP_LOGPROBS
from sluice.model.llama import KVCache, Llama
from sluice.model.paged_attend import AttentionMetadata, flat_pool, layered_pool, make_paged_attend


@dataclass(frozen=True, order=True)
class Bucket:
    """A compiled step shape: tokens, attention rows (sequences or prefill pieces), sampled rows, max_q_len,
    and decode steps per call. A speculative multi-step call (`verifies`) is a multi-step call of S
    sequences (its tokens) whose steps each take 1 + k queries per sequence (max_q_len)."""

    num_tokens: int
    num_attn_seqs: int
    num_rows: int
    max_q_len: int
    num_steps: int = 1

    @property
    def verifies(self) -> bool:
        return self.num_steps > 1 and self.max_q_len > 1


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftState:
    """Drafting in a speculative multi-step call. history: [S, H] int32, each drafting row's tokens (prompt +
    output) then -1, all -1 for a row that does not draft; max_drafts: [S] int32, the most drafts a row checks
    at a step (0: it does not draft)."""

    history: jax.Array
    max_drafts: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """token_ids, positions, slot_mapping: [T] int32 (slot -1 = padding); kv_lens: [S] int32;
    attn_slots: [S] int32, the slot whose page table each attention row reads (`input_batch.py`; the padding
    slot for padding rows); cu_q_lens: [S + 1] int32; logits_rows: [S] int32, each
    sequence's last token row (the one it samples from); limits: [S] int32, decode steps each row may run
    in a multi-step call (0 for padding); num_sampled: [] int32, the rows of logits_rows that are sampled (the
    first ones; real tokens are the first cu_q_lens[-1] rows); drafting: a speculative multi-step call's
    `DraftState` (no columns of history for other calls); feed: [T] int32, for a token the host does not know
    yet (overlapped scheduling), the row of the previous step's last tokens that holds it, else -1; pool_ids: [T]
    int32, the row of `StepOutput.pooled` each token adds to, else -1; score_ids: [T] int32, the prompt token
    each token's logits score (`score_step`: the next one, for a sequence that wants prompt logprobs), else
    -1. Padding rows' outputs are never read, and the CPU kernels skip them."""

    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    kv_lens: jax.Array
    attn_slots: jax.Array
    cu_q_lens: jax.Array
    logits_rows: jax.Array
    limits: jax.Array
    num_sampled: jax.Array
    drafting: DraftState
    feed: jax.Array
    pool_ids: jax.Array
    score_ids: jax.Array

    def fed(self, last_tokens: jax.Array) -> StepInputs:
        """With the tokens the previous step sampled ([R] int32, `last_tokens`) in place of the placeholders."""
        fed = last_tokens[jnp.maximum(self.feed, 0)]
        return replace(self, token_ids=jnp.where(self.feed >= 0, fed, self.token_ids))


Packing = tuple[jax.tree_util.PyTreeDef, tuple[tuple[tuple[int, ...], str], ...]]  # structure, (shape, dtype)s


def pack(tree) -> tuple[np.ndarray, Packing]:
    """A pytree of numpy arrays of 4-byte dtypes (int32, uint32, float32) as one flat int32 buffer: they cross to
    the device in one copy instead of one per array (each costs about 11 us of jit dispatch on a CPU). The packing
    is static (a compiled step's key)."""
    leaves, treedef = jax.tree.flatten(tree)
    flat = np.concatenate([np.ascontiguousarray(x).view(np.int32).ravel() for x in leaves])
    return flat, (treedef, tuple((x.shape, x.dtype.str) for x in leaves))


def unpack(flat: jax.Array, packing: Packing):
    treedef, specs = packing
    parts = jnp.split(flat, np.cumsum([int(np.prod(shape)) for shape, _ in specs])[:-1])
    return jax.tree.unflatten(treedef, [jax.lax.bitcast_convert_type(part, jnp.dtype(dtype)).reshape(shape)
                                        for part, (shape, dtype) in zip(parts, specs)])


def write_packed(packing: Packing, table: SlotRows, flat: jax.Array) -> SlotRows:
    """`write_rows` of a packed `SlotWrites` (its slots and rows: `pack`)."""
    return write_rows(table, *unpack(flat, packing))


def packed_step(step: partial, state_def: jax.tree_util.PyTreeDef) -> Callable:
    """`step` (a partial of `forward`, `decode_steps` or `verify_steps`) taking the model's weights as a flat
    list of arrays (`state_def` rebuilds the nnx.State inside: flattening a State at every call cost twice a list's,
    34 against 15 us for 30 unrolled layers) and its `StepInputs` and `SampledRows` packed (`pack`), the token
    histories apart (they stay on the device); named as the step, so its compiled program is too (profiles look
    for it)."""

    def run(packing: Packing, weights: list[jax.Array], kv_cache: KVCache, fed_from: jax.Array, slots: SlotRows,
            flat: jax.Array, history: jax.Array):
        inputs, sampled = unpack(flat, packing)
        state = jax.tree.unflatten(state_def, weights)
        return step(state, kv_cache, fed_from, slots, inputs, replace(sampled, history=history))

    run.__name__ = step.func.__name__
    return run


def last_tokens(tokens: jax.Array, num_rows: int) -> jax.Array:
    """tokens: [S] int32, each sampled row's last token -> [num_rows] int32, cut or zero-padded: what the next
    step may feed from (one shape whatever the bucket, so no step compiles once per previous bucket)."""
    tokens = tokens[:num_rows]
    return jnp.pad(tokens, (0, num_rows - tokens.shape[0]))


def _logits(model: Llama, backend: str, mesh: Mesh | None, num_pages: int, max_q_len: int, kv_cache: KVCache,
            page_table: jax.Array, adapters: jax.Array | None, inputs: StepInputs
            ) -> tuple[jax.Array, jax.Array, KVCache]:
    """One model step over a flat pool: the logits of the sampled rows, [S, V] float32, and the hidden states,
    [T, D]. page_table: [A, max_pages] int32, and adapters: [A] int32 (None: the model has no LoRA), each attention
    row's."""
    meta = AttentionMetadata(
        slot_mapping=inputs.slot_mapping, kv_lens=inputs.kv_lens, page_table=page_table,
        cu_q_lens=inputs.cu_q_lens, max_q_len=max_q_len,
    )
    attend = make_paged_attend(meta, num_pages, sm_scale=model.config.softmax_scale, backend=backend, mesh=mesh)
    hidden, kv_cache = model(inputs.token_ids, inputs.positions, kv_cache, attend, num_real=inputs.cu_q_lens[-1],
                             adapters=None if adapters is None else token_adapters(adapters, inputs.cu_q_lens,
                                                                                   inputs.token_ids.shape[0]))
    return model.logits(hidden[inputs.logits_rows], num_real=inputs.num_sampled), hidden, kv_cache


def token_adapters(adapters: jax.Array, cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """adapters: [A] int32, each attention row's; cu_q_lens: [A + 1] int32 -> [num_tokens] int32, each token's
    row's adapter (-1 for padding tokens, past cu_q_lens[-1])."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], tokens, side="right"), adapters.shape[0] - 1)
    return jnp.where(tokens < cu_q_lens[-1], adapters[row], -1)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptScores:
    """Per token of a step: logprobs [T] float32, the log-probability of the prompt token its logits score
    (`StepInputs.score_ids`), and ranks [T] int32, its rank in the vocabulary (1: the most likely); top_ids
    [T, 20] int32 and top_logprobs [T, 20] float32, the best alternatives, best first. Rows without a target hold
    values nobody reads."""

    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


SCORE_BLOCK = 256  # rows of logits a step scores at once: [256, V] float32 at most, whatever the step's tokens


def score_step(graphdef: nnx.GraphDef, state_def: jax.tree_util.PyTreeDef, weights: list[jax.Array],
               hidden: jax.Array, score_ids: jax.Array) -> PromptScores:
    """hidden: [T, D] (`forward`'s), score_ids: [T] int32 (-1: none) -> each row's `PromptScores` under the model's
    distribution (log-softmax of its logits), SCORE_BLOCK rows at a time. A program of its own, beside the step's,
    so that the first request for prompt logprobs compiles the LM head and its log-softmax, not a whole model step
    that would stall every running request meanwhile (logits for every token cost a step's worth of LM head)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))
    num_tokens = hidden.shape[0]
    block = min(SCORE_BLOCK, num_tokens)
    pad = -num_tokens % block
    blocks = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, block, hidden.shape[-1])
    targets = jnp.pad(score_ids, (0, pad)).reshape(-1, block)

    def score(rows_and_targets: tuple[jax.Array, jax.Array]) -> PromptScores:
        rows, ids = rows_and_targets
        logprobs = jax.nn.log_softmax(model.logits(rows), axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(ids, 0)[:, None], axis=-1)[:, 0]
        ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
        return PromptScores(chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)

    scores = jax.lax.map(score, (blocks, targets))
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:num_tokens], scores)


def _step_rows(graphdef: nnx.GraphDef, state: nnx.State, fed_from: jax.Array, slots: SlotRows, inputs: StepInputs,
               sampled: SampledRows) -> tuple[Llama, StepInputs, jax.Array, jax.Array | None, SamplingBatch]:
    """What a step reads, on the device: the model, `inputs` fed (`StepInputs.fed`), each attention row's page table
    ([A, max_pages] int32) and LoRA adapter ([A] int32; None for a model without LoRA), and the sampled rows'
    `SamplingBatch`, gathered from the slots' rows."""
    inputs = inputs.fed(fed_from)
    model = nnx.merge(graphdef, state)
    adapters = slots.adapter[inputs.attn_slots] if model.has_lora else None
    return model, inputs, slots.page_table[inputs.attn_slots], adapters, sampled.batch(slots.sampling)


def forward(graphdef: nnx.GraphDef, backend: str, mesh: Mesh | None, num_pages: int, max_q_len: int,
            state: nnx.State, kv_cache: KVCache, fed_from: jax.Array, slots: SlotRows, inputs: StepInputs,
            sampled: SampledRows
            ) -> tuple[tuple[jax.Array, SamplingBatch, jax.Array, jax.Array | None], KVCache]:
    """One step's model: the sampled rows' logits [S, V] float32, their `SamplingBatch`, the pooled rows
    [S, D] float32 (`StepInputs.pool_ids`; a few microseconds, always computed), and for a step that may compute
    prompt tokens (`max_q_len` > 1) their final hidden states [T, D], which `score_step` scores when a sequence
    wants prompt logprobs (on the device, unread otherwise); and the pool.

    kv_cache: (k, v), each [num_layers, num_pages, num_kv_heads, page_size, head_dim] (arrays or int8
    `QuantizedPages`; donated). fed_from: [R] int32, the previous step's last tokens (`StepInputs.fed`).
    slots: the persistent input batch's rows on the device. The sampling rows are gathered here rather than in
    the sampler: XLA's CPU sampler ran slower with the gathers in its own program (RESULTS.md, 2026-11-26).
    """
    model, inputs, page_table, adapters, sampling = _step_rows(graphdef, state, fed_from, slots, inputs, sampled)
    logits, hidden, kv_cache = _logits(model, backend, mesh, num_pages, max_q_len, flat_pool(kv_cache), page_table,
                                       adapters, inputs)
    pooled = model.pooled(hidden, inputs.pool_ids, inputs.logits_rows.shape[0])
    return ((logits, sampling, pooled, hidden if max_q_len > 1 else None),
            layered_pool(kv_cache, model.config.num_layers))


def sample_step(num_rows: int, plan: SamplerPlan | None, logits: jax.Array, sampling: SamplingBatch
                 ) -> tuple[SamplerOutput, jax.Array]:
    """One step's sampler, outputs with a leading [1] axis (as a multi-step call's), and its `last_tokens`."""
    out = sample(logits, sampling, plan)
    return jax.tree.map(lambda x: x[None], out), last_tokens(out.tokens, num_rows)


def _while_any_runs(step: Callable, running: Callable, plan: SamplerPlan | None, model: Llama) -> Callable:
    """A multi-step call's scan body: `step(carry, k)` while `running(carry, k)` ([S] bool) has a row left, then
    nothing (zeros out), so the steps a call has left once every sequence has ended cost nothing. Not with a
    `SamplerPlan` (the call then has no conditional, and runs every step), nor with the layers unrolled: XLA
    then copies the whole pool at every call to pass it through the conditional (`bench.step_audit`)."""
    if plan is not None or model.layers_unstacked:
        return step

    def body(carry, k):
        outs = jax.eval_shape(step, carry, k)[1]
        skip = lambda carry: (carry, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), outs))
        return jax.lax.cond(jnp.any(running(carry, k)), lambda carry: step(carry, k), skip, carry)

    return body


def decode_steps(graphdef: nnx.GraphDef, backend: str, mesh: Mesh | None, num_pages: int, page_size: int,
                  num_steps: int, num_rows: int, plan: SamplerPlan | None, state: nnx.State, kv_cache: KVCache,
                  fed_from: jax.Array, slots: SlotRows, inputs: StepInputs, sampled: SampledRows
                  ) -> tuple[tuple[SamplerOutput, jax.Array], KVCache]:
    """`num_steps` decode steps, model and sampler, each sampled token fed back; kv_cache, fed_from and slots as
    in `forward`.

    Returns the sampler's outputs with a leading [num_steps] axis, and each row's last token (at its limit)
    as `last_tokens`. No row has a structured-output mask: the host cannot fill one between the steps.
    """
    model, inputs, page_table, adapters, sampling = _step_rows(graphdef, state, fed_from, slots, inputs, sampled)
    rows = jnp.arange(inputs.token_ids.shape[0])

    def decode(carry, k):
        tokens, alive, kv_cache, sampling = carry
        active = alive & (k < inputs.limits)
        positions = inputs.positions + k
        pages = page_table[rows, positions // page_size]
        step_inputs = replace(
            inputs, token_ids=tokens, positions=positions,
            slot_mapping=jnp.where(active, pages * page_size + positions % page_size, -1),
            kv_lens=jnp.where(active, inputs.kv_lens + k, 0),
        )
        logits, _, kv_cache = _logits(model, backend, mesh, num_pages, 1, kv_cache, page_table, adapters, step_inputs)
        out = sample(logits, sampling, plan)
        alive = alive & ~(active & sampling.stops(out.tokens))
        # A row past its end computes padding, whose logprob may not be finite: zeroed, so that the host checks
        # every step's (`StepOutput.nonfinite`).
        out = replace(out, logprobs=jnp.where(active, out.logprobs, 0.0))
        return (out.tokens, alive, kv_cache, sampling.advanced(out.tokens)), out

    init = (inputs.token_ids, inputs.limits > 0, flat_pool(kv_cache), sampling)
    body = _while_any_runs(decode, lambda carry, k: carry[1] & (k < inputs.limits), plan, model)
    (_, _, kv_cache, _), outs = jax.lax.scan(body, init, jnp.arange(num_steps))
    at_limit = jnp.take_along_axis(outs.tokens, jnp.maximum(inputs.limits - 1, 0)[None], axis=0)[0]
    return (outs, last_tokens(at_limit, num_rows)), layered_pool(kv_cache, model.config.num_layers)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifiedSteps:
    """A speculative multi-step call's outputs. `sampled`: leaves [num_steps, S * (1 + k), ...], sequence s's
    rows at each step s * (1 + k) + j; `num_emitted`: [num_steps, S] int32, how many of those rows (a prefix)
    are its tokens; `num_verified`: [num_steps, S] int32, how many drafts it checked at that step."""

    sampled: SamplerOutput
    num_emitted: jax.Array
    num_verified: jax.Array


def verify_steps(graphdef: nnx.GraphDef, backend: str, mesh: Mesh | None, num_pages: int, page_size: int,
                  ngram: NgramConfig, num_steps: int, num_rows: int, plan: SamplerPlan | None, state: nnx.State,
                  kv_cache: KVCache, fed_from: jax.Array, slots: SlotRows, inputs: StepInputs, sampled: SampledRows
                  ) -> tuple[tuple[VerifiedSteps, jax.Array], KVCache]:
    """`num_steps` decode steps in which each drafting sequence also checks up to k drafts, proposed on the
    device from its tokens at every step (`propose_on_device`; k = ngram.num_speculative_tokens).

    `inputs` is a decode step's (one row per sequence: its last token, position, pages and token limit) with
    `drafting`. At each step a sequence computes its last token and its drafts as one causal query run (the runs
    packed, ragged, so the CPU kernels compute only real tokens), every position is sampled with the draft
    after it to verify (`sample`), and the sequence keeps its accepted drafts and the token after them, up to a
    stop id or its limit. Positions written for rejected drafts lie beyond what the sequence keeps, and are
    overwritten later. The sampler's outputs are returned as `VerifiedSteps`.
    """
    model, inputs, page_table, adapters, sampling = _step_rows(graphdef, state, fed_from, slots, inputs, sampled)
    width = 1 + ngram.num_speculative_tokens
    num_seqs = inputs.token_ids.shape[0]
    may_draft = inputs.drafting.max_drafts > 0
    seqs = jnp.arange(num_seqs)
    token_rows = jnp.arange(num_seqs * width)
    offsets = jnp.arange(width)

    def verify(carry, _):
        last, emitted, history, alive, kv_cache, sampling = carry
        drafts, num_drafts = propose_on_device(history, ngram)
        room = jnp.minimum(jnp.minimum(num_drafts, inputs.drafting.max_drafts), inputs.limits - emitted - 1)
        q_lens = jnp.where(alive, 1 + jnp.clip(room, 0, width - 1), 0)
        cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
        owner = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token_rows, side="right"), num_seqs - 1)
        offset = token_rows - cu_q_lens[owner]  # each token's place in its sequence's run
        real = token_rows < cu_q_lens[-1]
        start = inputs.positions + emitted  # where each sequence's last token goes
        positions = jnp.where(real, start[owner] + offset, 0)
        draft_at = lambda j: drafts[owner, jnp.clip(j, 0, width - 2)]
        pages = page_table[owner, positions // page_size]
        step_inputs = replace(
            inputs, token_ids=jnp.where(offset == 0, last[owner], draft_at(offset - 1)), positions=positions,
            slot_mapping=jnp.where(real, pages * page_size + positions % page_size, -1),
            kv_lens=jnp.where(q_lens > 0, start + q_lens, 0), cu_q_lens=cu_q_lens, logits_rows=token_rows,
            num_sampled=cu_q_lens[-1],
        )
        logits, _, kv_cache = _logits(model, backend, mesh, num_pages, width, kv_cache, page_table, adapters,
                                      step_inputs)
        checks = real & (offset < q_lens[owner] - 1)
        rows = replace(jax.tree.map(lambda x: x[owner], sampling), step=sampling.step[owner] + offset,
                       draft=jnp.where(checks, draft_at(offset), -1))
        out = sample(logits, rows, plan)
        # Per sequence, its run's rows [S, width]: keep the accepted drafts and the token after them.
        grid = jax.tree.map(lambda x: x[jnp.minimum(cu_q_lens[:-1, None] + offsets, token_rows[-1])], out)
        accepted = grid.accepted & (offsets < q_lens[:, None] - 1)
        num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1)
        stopping = sampling.stops(grid.tokens) & (offsets <= num_accepted[:, None])
        stopped = alive & jnp.any(stopping, axis=1)
        kept = jnp.where(alive, jnp.where(stopped, jnp.argmax(stopping, axis=1), num_accepted) + 1, 0)
        last = jnp.where(kept > 0, grid.tokens[seqs, jnp.maximum(kept - 1, 0)], last)
        # Drafting rows' histories grow by what they kept (the others stay empty: they never draft).
        at = jnp.where(may_draft[:, None] & (offsets < kept[:, None]),
                       inputs.positions[:, None] + 1 + emitted[:, None] + offsets, history.shape[1])
        history = history.at[seqs[:, None], at].set(grid.tokens, mode="drop")
        emitted = emitted + kept
        carry = (last, emitted, history, alive & ~stopped & (emitted < inputs.limits), kv_cache,
                 sampling.advanced(last, kept))
        # Rows a sequence does not keep (another sequence's, or a rejected draft's) zeroed, as in `decode_steps`.
        grid = replace(grid, logprobs=jnp.where(offsets < kept[:, None], grid.logprobs, 0.0))
        flat = jax.tree.map(lambda x: x.reshape(num_seqs * width, *x.shape[2:]), grid)
        return carry, VerifiedSteps(flat, kept, jnp.maximum(q_lens - 1, 0))

    init = (inputs.token_ids, jnp.zeros(num_seqs, jnp.int32), inputs.drafting.history, inputs.limits > 0,
            flat_pool(kv_cache), sampling)
    body = _while_any_runs(verify, lambda carry, _: carry[3], plan, model)
    (last, *_, kv_cache, _), outs = jax.lax.scan(body, init, jnp.arange(num_steps))
    return (outs, last_tokens(last, num_rows)), layered_pool(kv_cache, model.config.num_layers)
