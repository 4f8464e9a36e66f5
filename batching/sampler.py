"""Batched token sampling with per-row parameters, as one pure jittable function.

Every row carries its own temperature, filters, penalties and seed. A row's random draw depends only on
(its seed, its output step), through `jax.random.fold_in`, so a seeded request samples the same tokens whatever
else shares its batch. Filters never reorder the noise: the Gumbel noise is indexed by token id, and top-k,
top-p and min-p become a per-row logit cutoff.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np

from batching.sampling_params import MAX_TOP_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One sequence's sampling settings as the sampler packs them, built once when its request is added.

    Every field is a per-row scalar of `SamplingBatch` with the same name; `seed` is the row's own (uint32).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    @classmethod
    def from_params(cls, params: SamplingParams, seed: int, vocab_size: int) -> SamplingRow:
        """top_k beyond the vocabulary means no top-k filter, as in vLLM."""
        return cls(
            temperature=params.temperature,
            top_k=params.top_k if 0 < params.top_k < vocab_size else 0,
            top_p=params.top_p,
            min_p=params.min_p,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            seed=seed % 2**32,
        )

    @property
    def reads_history(self) -> bool:
        """Whether the penalties need the row's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


_ROW_DTYPES = {
    field.name: np.uint32 if field.name == "seed" else {float: np.float32, int: np.int32}[type(field.default)]
    for field in fields(SamplingRow)
}
_PADDING_ROW = SamplingRow()


@dataclass(frozen=True)
class SamplingInputs:
    """What the sampler needs about one scheduled sequence this step.

    `step` is the index of the token being sampled among the sequence's outputs; `token_ids` (prompt + output,
    of which the first `num_prompt` are the prompt) is read only when the row's penalties need it; `banned`
    are ids the row must not sample now (stop ids before min_tokens).
    """

    row: SamplingRow
    step: int
    token_ids: list[int]
    num_prompt: int
    banned: tuple[int, ...]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters for S rows (padding rows are greedy with no penalties).

    temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty: [S] float32
    top_k: [S] int32 (<= 0 disables); seed: [S] uint32; step: [S] int32 (the row's output index)
    banned: [S, B] int32 token ids that must not be sampled (EOS/stop ids before min_tokens), -1 pads
    history: [S, L] int32 the row's prompt + output ids, -1 pads; num_prompt: [S] int32 prompt length
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    seed: jax.Array
    step: jax.Array
    banned: jax.Array
    history: jax.Array
    num_prompt: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """tokens: [S] int32; logprobs: [S] float32 of the chosen token under the model's distribution;
    top_ids: [S, 20] int32 and top_logprobs: [S, 20] float32, best first."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def pack_sampling_batch(inputs: list[SamplingInputs], num_rows: int, history_len: int, num_banned: int
                        ) -> SamplingBatch:
    """Host-side arrays for `inputs`, padded to `num_rows`. Token history is filled only for rows that read it."""
    rows = [i.row for i in inputs] + [_PADDING_ROW] * (num_rows - len(inputs))
    scalars = {name: np.array([getattr(r, name) for r in rows], dtype) for name, dtype in _ROW_DTYPES.items()}
    step = np.zeros(num_rows, np.int32)
    banned = np.full((num_rows, num_banned), -1, np.int32)
    history = np.full((num_rows, history_len), -1, np.int32)
    num_prompt = np.zeros(num_rows, np.int32)
    for i, row_inputs in enumerate(inputs):
        step[i] = row_inputs.step
        banned[i, :len(row_inputs.banned)] = row_inputs.banned
        if row_inputs.row.reads_history:
            history[i, :len(row_inputs.token_ids)] = row_inputs.token_ids
            num_prompt[i] = row_inputs.num_prompt
    return SamplingBatch(**scalars, step=step, banned=banned, history=history, num_prompt=num_prompt)


def apply_penalties(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """OpenAI presence/frequency penalties on output tokens; repetition penalty on prompt and output tokens."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    valid = batch.history >= 0
    ids = jnp.where(valid, batch.history, vocab)  # out of range: dropped by the scatters
    is_output = valid & (jnp.arange(batch.history.shape[1])[None, :] >= batch.num_prompt[:, None])
    out_counts = jnp.zeros_like(logits).at[rows, ids].add(is_output.astype(logits.dtype), mode="drop")
    seen = jnp.zeros(logits.shape, jnp.bool_).at[rows, ids].set(True, mode="drop")
    rep = batch.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - batch.frequency_penalty[:, None] * out_counts
    return logits - batch.presence_penalty[:, None] * (out_counts > 0).astype(logits.dtype)


def filter_cutoff(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """scaled: [S, V] temperature-scaled logits -> [S, 1] the smallest logit top-k, top-p and min-p keep."""
    vocab = scaled.shape[1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(batch.top_k > 0, jnp.minimum(batch.top_k, vocab), vocab)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.maximum(jnp.sum(mass_before < batch.top_p[:, None], axis=-1), 1)
    top_p_cut = jnp.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)
    min_p_cut = desc[:, :1] + jnp.log(jnp.maximum(batch.min_p, 1e-30))[:, None]
    min_p_cut = jnp.where(batch.min_p[:, None] > 0, min_p_cut, -jnp.inf)
    return jnp.maximum(jnp.maximum(kth, top_p_cut), min_p_cut)


def _row_gumbel(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def sample(logits: jax.Array, batch: SamplingBatch) -> SamplerOutput:
    """logits: [S, V] float32 -> SamplerOutput. Greedy rows (temperature 0) take the argmax."""
    num_rows, vocab = logits.shape
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    any_penalty = jnp.any(
        (batch.presence_penalty != 0) | (batch.frequency_penalty != 0) | (batch.repetition_penalty != 1)
    )
    logits = jax.lax.cond(any_penalty, apply_penalties, lambda x, _: x, logits, batch)
    rows = jnp.arange(num_rows)[:, None]
    banned = jnp.where(batch.banned >= 0, batch.banned, vocab)
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits: jax.Array) -> jax.Array:
        scaled = logits / jnp.maximum(batch.temperature, 1e-6)[:, None]
        any_filter = jnp.any((batch.top_k > 0) | (batch.top_p < 1) | (batch.min_p > 0))
        cutoff = jax.lax.cond(
            any_filter, filter_cutoff, lambda s, _: jnp.full((num_rows, 1), -jnp.inf, s.dtype), scaled, batch
        )
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
        noise = jax.vmap(_row_gumbel, in_axes=(0, 0, None))(batch.seed, batch.step, vocab)
        drawn = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
        return jnp.where(batch.temperature > 0, drawn, greedy_tokens)

    tokens = jax.lax.cond(jnp.any(batch.temperature > 0), draw, lambda _: greedy_tokens, logits)
    chosen = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs_all, MAX_TOP_LOGPROBS)
    return SamplerOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
