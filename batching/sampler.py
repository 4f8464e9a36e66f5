"""Batched token sampling with per-row parameters, as one pure jittable function.

Every row carries its own temperature, filters, penalties and seed. A row's draw is one uniform number that
depends only on (its seed, its output step), through `jax.random.fold_in`, inverted through the row's own
cumulative distribution in token-id order: a seeded request samples the same tokens whatever else shares its
batch. Top-k, top-p and min-p become a per-row logit cutoff. Work that no row asks for (penalties, filters,
sampling, top alternatives) is skipped: decided by the host from the step's rows (a `SamplerPlan`, a static
argument), or without one on the device with `lax.cond`. XLA:GPU runs a conditional by copying its predicate to
the host and waiting for the device, so on a GPU the host decides (`model_runner.py`); on a CPU a conditional
costs nothing and spares a compiled sampler per plan. Structured output masks the logits before they get here
(`mask_disallowed`, its own call, made only for steps with a constrained row).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sluice.batching.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters for S rows (padding rows are greedy with no penalties): the one form they
    take from a request's `SamplingParams` to the device.

    Per sequence (`write`): temperature, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty:
    [S] float32; top_k: [S] int32 (<= 0 disables); top_logprobs: [S] int32 (alternatives the row reports);
    seed: [S] uint32; stop_ids: [S, B] int32 ids that end the row (EOS and stop ids), -1 pads; min_tokens: [S]
    int32, the output index before which stop ids are banned; num_prompt: [S] int32 prompt length; bias_ids:
    [S, MAX_LOGIT_BIAS] int32, -1 pads, and bias: [S, MAX_LOGIT_BIAS] float32, what `logit_bias` adds to those
    ids' logits (`SamplingParams.biased_ids`); exclusive: [S] int32, 1 if those ids are the only ones the row may
    sample (`allowed_token_ids`).
    Per step (`SampledRows`): step: [S] int32, the row's output index; draft: [S] int32, the token proposed for
    the row's position (-1: none); history: [S, L] int32, the row's prompt + output ids, -1 pads (filled only
    for rows whose penalties read it).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    top_logprobs: jax.Array
    seed: jax.Array
    step: jax.Array
    stop_ids: jax.Array
    min_tokens: jax.Array
    history: jax.Array
    num_prompt: jax.Array
    draft: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    exclusive: jax.Array

    @classmethod
    def empty(cls, num_rows: int, num_banned: int, history_len: int = 0) -> SamplingBatch:
        """Host arrays (numpy) of `num_rows` padding rows, to `write` into."""
        floats = lambda value: np.full(num_rows, value, np.float32)
        ints = lambda value: np.full(num_rows, value, np.int32)
        return cls(temperature=floats(0.0), top_k=ints(0), top_p=floats(1.0), min_p=floats(0.0),
                   presence_penalty=floats(0.0), frequency_penalty=floats(0.0), repetition_penalty=floats(1.0),
                   top_logprobs=ints(0), seed=np.zeros(num_rows, np.uint32), step=ints(0),
                   stop_ids=np.full((num_rows, num_banned), -1, np.int32), min_tokens=ints(0),
                   history=np.full((num_rows, history_len), -1, np.int32), num_prompt=ints(0), draft=ints(-1),
                   bias_ids=np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32),
                   bias=np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32), exclusive=ints(0))

    def write(self, row: int, params: SamplingParams, seed: int, stop_ids: tuple[int, ...], num_prompt: int,
              vocab_size: int) -> None:
        """Sets a row's per-sequence fields in place (host arrays). top_k beyond the vocabulary means no top-k
        filter, as in vLLM."""
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if 0 < params.top_k < vocab_size else 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.top_logprobs[row] = params.top_logprobs
        self.seed[row] = seed % 2**32
        self.stop_ids[row] = -1
        self.stop_ids[row, :len(stop_ids)] = stop_ids
        self.min_tokens[row] = params.min_tokens
        self.num_prompt[row] = num_prompt
        self.bias_ids[row], self.bias[row] = -1, 0.0
        if params.biased_ids:
            ids, biases = zip(*params.biased_ids)
            self.bias_ids[row, :len(ids)], self.bias[row, :len(ids)] = ids, biases
        self.exclusive[row] = bool(params.allowed_token_ids)

    def penalized(self) -> jax.Array:
        """[S] bool: rows with a penalty, which reads the row's token history (numpy or jax arrays alike)."""
        return (self.presence_penalty != 0) | (self.frequency_penalty != 0) | (self.repetition_penalty != 1)

    def needs(self) -> dict[str, jax.Array]:
        """For each of `sample`'s optional passes (a `SamplerPlan` field), [S] bool: the rows that need it
        (numpy or jax arrays alike). Filters matter only to sampling rows."""
        sampling = self.temperature > 0
        return dict(sampling=sampling, penalties=self.penalized(), top_k=sampling & (self.top_k > 0),
                    top_p=sampling & (self.top_p < 1), min_p=sampling & (self.min_p > 0),
                    top_logprobs=self.top_logprobs > 0, logit_bias=self.bias_ids[:, 0] >= 0,
                    min_tokens=self.min_tokens > 0)

    def stops(self, tokens: jax.Array) -> jax.Array:
        """tokens: [S] int32 sampled at `step`, or [S, W] sampled at steps `step` to `step + W - 1` -> bool of
        the same shape, whether each ends its row (a stop id, min_tokens met)."""
        run = tokens.reshape(tokens.shape[0], -1)
        steps = self.step[:, None] + jnp.arange(run.shape[1])
        hits = jnp.any(run[:, :, None] == self.stop_ids[:, None, :], axis=-1) & (steps >= self.min_tokens[:, None])
        return hits.reshape(tokens.shape)

    def advanced(self, tokens: jax.Array, counts: jax.Array | int = 1) -> SamplingBatch:
        """The batch `counts` tokens later for every row (0 or 1 for rows whose penalties read their history),
        `tokens` (each row's last one) appended to the histories that are kept."""
        rows = jnp.arange(tokens.shape[0])
        index = self.num_prompt + self.step  # where the row's next output token goes in its history
        reads = (self.history[:, 0] >= 0) & (counts > 0)  # histories are filled only for rows whose penalties read them
        history = self.history.at[rows, jnp.where(reads, index, self.history.shape[1])].set(tokens, mode="drop")
        return replace(self, step=self.step + counts, history=history)


SAMPLER_BRANCHES = ("auto", "device", "host")


def resolve_sampler_branches(choice: str) -> str:
    """"device" or "host" for a `SAMPLER_BRANCHES` choice: who decides which of the sampler's passes a step runs.
    "auto": the host off the CPU, the device (`lax.cond`) on it (see the module docstring)."""
    if choice == "auto":
        return "device" if jax.default_backend() == "cpu" else "host"
    return choice


@dataclass(frozen=True)
class SamplerPlan:
    """Which of `sample`'s optional passes a step's rows need: some row samples (temperature > 0), is penalized,
    filters by top-k, top-p or min-p (sampling rows), wants top alternatives, biases logits, or holds its stop ids
    back for min_tokens."""

    sampling: bool = False
    penalties: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    top_logprobs: bool = False
    logit_bias: bool = False
    min_tokens: bool = False

    @classmethod
    def of(cls, table: SamplingBatch, slots: np.ndarray) -> SamplerPlan:
        """For the rows of `slots` in a host (numpy) table of per-sequence parameters (`SamplingBatch.needs`)."""
        return cls(**{name: bool(rows[slots].any()) for name, rows in table.needs().items()})

    @classmethod
    def for_params(cls, params: SamplingParams, vocab_size: int) -> SamplerPlan:
        """For rows that sample with `params`."""
        table = SamplingBatch.empty(1, 0)
        table.write(0, params, 0, (), 0, vocab_size)
        return cls.of(table, np.zeros(1, np.int32))


# Each pass is exact per row whichever rows need it, so this plan samples any rows as their own plan would.
EVERY_PASS = SamplerPlan(*[True] * len(fields(SamplerPlan)))


def _branch(plan: SamplerPlan | None, needs: dict[str, jax.Array], passes: tuple[str, ...], then: Callable,
            otherwise: Callable, *operands):
    """`then(*operands)` if some row needs one of `passes`, else `otherwise(*operands)`: as the host decided
    (`plan`), or without a plan on the device, from `needs` (`SamplingBatch.needs`)."""
    if plan is None:
        return jax.lax.cond(jnp.any(jnp.stack([needs[name] for name in passes])), then, otherwise, *operands)
    return (then if any(getattr(plan, name) for name in passes) else otherwise)(*operands)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """tokens: [S] int32; logprobs: [S] float32 of the chosen token under the model's distribution;
    top_ids: [S, 20] int32 and top_logprobs: [S, 20] float32, best first (zeros when no row asks for them);
    accepted: [S] bool, whether the row's draft was accepted (then `tokens` is the draft)."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    accepted: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SampledRows:
    """A step's sampled rows, each taking its sequence's parameters from a table of them (a `SamplingBatch` with
    a row per sequence): slot: [R] int32, the table's row for each; step, draft: [R] int32 and history: [R, L]
    int32, as in `SamplingBatch`."""

    slot: jax.Array
    step: jax.Array
    draft: jax.Array
    history: jax.Array

    def batch(self, table: SamplingBatch) -> SamplingBatch:
        # jnp.take, not jnp's indexing: the same rows (every slot is in range), 7x faster to trace, for each field.
        rows = jax.tree.map(lambda x: jnp.take(x, self.slot, axis=0, mode="clip"), table)
        return replace(rows, step=self.step, draft=self.draft, history=self.history)


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a packed token bitmask: bit `t % 32` of word `t // 32` stands for token t."""
    return -(-vocab_size // 32)


def mask_disallowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits: [S, V]; allowed: [S, ceil(V / 32)] int32 packed bits -> logits, -inf where a bit is 0.

    Structured output's mask, applied before `sample` (so before penalties, filters and logprobs): a row then
    samples, verifies drafts and reports logprobs under the model's distribution restricted to what its grammar
    allows. Rows without a grammar in a step that has one pass all-ones rows.
    """
    num_rows, vocab = logits.shape
    bits = jnp.right_shift(allowed[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return jnp.where(bits.reshape(num_rows, -1)[:, :vocab] != 0, logits, -jnp.inf)


def add_logit_bias(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """OpenAI's logit_bias: each row's biases added to its ids' logits (a bias of -100 all but bans a token); an
    exclusive row's other ids banned (vLLM's allowed_token_ids)."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    ids = jnp.where(batch.bias_ids >= 0, batch.bias_ids, vocab)  # out of range: dropped by the scatter
    biased = logits.at[rows, ids].add(batch.bias, mode="drop")
    listed = jnp.zeros(logits.shape, bool).at[rows, ids].set(True, mode="drop")
    return jnp.where((batch.exclusive[:, None] > 0) & ~listed, -jnp.inf, biased)


def left_nothing(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """logits: [S, V] (a grammar's mask applied) -> [S] bool, the rows allowed_token_ids leaves no token: those whose
    allowed ids' logits are all -inf. The sampler takes index 0 out of nothing there, so it reports them (a NaN
    logprob); no other pass can leave a row nothing."""
    listed = jnp.take_along_axis(logits, jnp.maximum(batch.bias_ids, 0), axis=-1)
    return (batch.exclusive > 0) & jnp.all((batch.bias_ids < 0) | (listed == -jnp.inf), axis=-1)


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


# XLA's CPU sort is orders of magnitude slower than a pass over the logits (a full-vocabulary sort of 64 rows
# took a second), and so is its argmax (a variadic reduce): the filters bisect for their cutoffs instead of
# sorting, and argmax goes through block maxima.
_BISECTION_STEPS = 32
_ARGMAX_BLOCK = 128


def argmax(x: jax.Array) -> jax.Array:
    """x: [S, V] -> [S] int32, the first index of each row's maximum (as jnp.argmax), through block maxima."""
    num_rows, vocab = x.shape
    pad = -vocab % _ARGMAX_BLOCK
    blocks = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(num_rows, -1, _ARGMAX_BLOCK)
    best_block = jnp.argmax(blocks.max(axis=-1), axis=-1)
    within = jnp.argmax(jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0], axis=-1)
    return (best_block * _ARGMAX_BLOCK + within).astype(jnp.int32)


def largest_cutoff(x: jax.Array, measure, target: jax.Array) -> jax.Array:
    """The largest value c of each row with measure(x >= c) >= target, for a measure that shrinks as c grows.

    x: [S, V] (-inf entries are never kept); measure: [S, V] bool -> [S, 1]; target: [S, 1]. Bisects between
    the row's smallest finite value (which keeps everything) and above its maximum, then snaps to a value of x.
    """
    finite = jnp.isfinite(x)
    lo = jnp.min(jnp.where(finite, x, jnp.inf), axis=-1, keepdims=True)
    hi = jnp.max(x, axis=-1, keepdims=True) + 1.0

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        keeps_enough = measure(x >= mid) >= target
        return jnp.where(keeps_enough, mid, lo), jnp.where(keeps_enough, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECTION_STEPS, halve, (lo, hi))
    return jnp.min(jnp.where(x >= lo, x, jnp.inf), axis=-1, keepdims=True)


def filter_cutoff(scaled: jax.Array, batch: SamplingBatch, plan: SamplerPlan | None = None) -> jax.Array:
    """scaled: [S, V] temperature-scaled logits -> [S, 1] the smallest logit top-k, top-p and min-p keep.

    Top-p counts the mass of what top-k keeps (both act on the same ranking, as with a sort).
    """
    vocab = scaled.shape[1]
    needs = batch.needs()
    k = jnp.where(batch.top_k > 0, jnp.minimum(batch.top_k, vocab), vocab)[:, None]
    kth = _branch(
        plan, needs, ("top_k",),
        lambda: largest_cutoff(scaled, lambda kept: jnp.sum(kept, axis=-1, keepdims=True), k),
        lambda: jnp.full_like(scaled[:, :1], -jnp.inf),
    )
    top_k_kept = jnp.where(scaled >= kth, scaled, -jnp.inf)
    probs = jax.nn.softmax(top_k_kept, axis=-1)
    top_p = batch.top_p[:, None]
    top_p_cut = _branch(
        plan, needs, ("top_p",),
        lambda: jnp.where(top_p < 1, largest_cutoff(
            top_k_kept, lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), axis=-1, keepdims=True), top_p,
        ), -jnp.inf),
        lambda: jnp.full_like(kth, -jnp.inf),
    )
    min_p_cut = scaled.max(axis=-1, keepdims=True) + jnp.log(jnp.maximum(batch.min_p, 1e-30))[:, None]
    min_p_cut = jnp.where(batch.min_p[:, None] > 0, min_p_cut, -jnp.inf)
    return jnp.maximum(jnp.maximum(kth, top_p_cut), min_p_cut)


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    """[] float32 in [0, 1) keyed by (seed, step): the row's draw."""
    return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step), (), jnp.float32)


def _first_past(mass_through: jax.Array, mass: jax.Array, u: jax.Array) -> jax.Array:
    """mass_through, mass: [S, N]; u: [S, 1] -> [S] int32, the first index with mass whose cumulative mass exceeds
    u, else the last index with mass. Indices without mass are never taken: the block sums and the cumulative sums
    round differently, so u may fall in a gap between them (a zero-probability token taken about once in a million
    draws, a grammar's masked token among them)."""
    index = jnp.arange(mass.shape[-1])
    first = jnp.min(jnp.where((mass > 0) & (mass_through > u), index, mass.shape[-1]), axis=-1)
    last = jnp.max(jnp.where(mass > 0, index, 0), axis=-1)
    return jnp.where(first < mass.shape[-1], first, last).astype(jnp.int32)


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """probs: [S, V] (rows sum to 1), u: [S] in [0, 1) -> [S] int32, the first token whose cumulative mass
    exceeds u, always one of positive probability. Cumulates over blocks first: a full-width cumulative sum is
    slow on the CPU."""
    num_rows, vocab = probs.shape
    pad = -vocab % _ARGMAX_BLOCK
    blocks = jnp.pad(probs, ((0, 0), (0, pad))).reshape(num_rows, -1, _ARGMAX_BLOCK)
    block_mass = blocks.sum(axis=-1)
    mass_through = jnp.cumsum(block_mass, axis=-1)
    u = u[:, None] * mass_through[:, -1:]  # the rows' own total, rounding included
    block = _first_past(mass_through, block_mass, u)
    before = jnp.take_along_axis(mass_through - block_mass, block[:, None], axis=-1)
    chosen = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    token = block * _ARGMAX_BLOCK + _first_past(jnp.cumsum(chosen, axis=-1) + before, chosen, u)
    return jnp.minimum(token, vocab - 1).astype(jnp.int32)


def hold_stop_ids(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """logits: [S, V] with each row's stop ids at -inf before its min_tokens-th token, unless they are all the row
    may take (its grammar, complete before min_tokens, allows nothing but its end). Two passes over the logits:
    only for steps with a row that has min_tokens."""
    num_rows, vocab = logits.shape
    banned = jnp.where((batch.stop_ids >= 0) & (batch.step < batch.min_tokens)[:, None], batch.stop_ids, vocab)
    held = logits.at[jnp.arange(num_rows)[:, None], banned].set(-jnp.inf, mode="drop")
    return jnp.where(jnp.any(held > -jnp.inf, axis=-1, keepdims=True), held, logits)


def sample(logits: jax.Array, batch: SamplingBatch, plan: SamplerPlan | None = None) -> SamplerOutput:
    """logits: [S, V] float32 -> SamplerOutput. Each row's logit_bias, penalties and min_tokens ban (of its stop ids,
    unless nothing else is allowed) apply first;
    then greedy rows (temperature 0) take the argmax, and the others draw from the filtered, temperature-scaled
    distribution p with one uniform number keyed by (seed, step). Logprobs are the model's, before all of these;
    NaN for a row they leave no token to take.

    A row with a draft d (one token, proposed by n-gram lookup) keeps it if d is the token the row samples: the
    argmax for a greedy row; for a sampling row, with probability p(d), the acceptance rate of speculative
    sampling's verification for a draft of one sure token. Every row emits the token it samples, draft or not,
    so a seeded request's tokens are those it gets without speculation. `plan`: the passes the rows need, as the
    host decided (None: decided here, on the device); the outputs are the same either way.
    """
    num_rows, vocab = logits.shape
    log_normalizer = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    model_logits = logits
    needs = batch.needs()
    logits = _branch(plan, needs, ("logit_bias",), add_logit_bias, lambda x, _: x, logits, batch)
    logits = _branch(plan, needs, ("penalties",), apply_penalties, lambda x, _: x, logits, batch)
    logits = _branch(plan, needs, ("min_tokens",), hold_stop_ids, lambda x, _: x, logits, batch)
    greedy_tokens = argmax(logits)

    def draw(logits: jax.Array) -> jax.Array:
        scaled = logits / jnp.maximum(batch.temperature, 1e-6)[:, None]
        cutoff = _branch(
            plan, needs, ("top_k", "top_p", "min_p"),
            lambda s: filter_cutoff(s, batch, plan), lambda s: jnp.full((num_rows, 1), -jnp.inf, s.dtype), scaled,
        )
        probs = jax.nn.softmax(jnp.where(scaled >= cutoff, scaled, -jnp.inf), axis=-1)
        drawn = inverse_cdf(probs, jax.vmap(_row_uniform)(batch.seed, batch.step))
        return jnp.where(needs["sampling"], drawn, greedy_tokens)

    tokens = _branch(plan, needs, ("sampling",), draw, lambda _: greedy_tokens, logits)
    accepted = (batch.draft >= 0) & (tokens == batch.draft)
    chosen = jnp.take_along_axis(model_logits, tokens[:, None], axis=-1)[:, 0] - log_normalizer[:, 0]
    chosen = _branch(plan, needs, ("logit_bias",), lambda c: jnp.where(left_nothing(model_logits, batch), jnp.nan, c),
                     lambda c: c, chosen)

    def top_alternatives() -> tuple[jax.Array, jax.Array]:
        values, ids = jax.lax.top_k(model_logits, MAX_TOP_LOGPROBS)
        return values - log_normalizer, ids.astype(jnp.int32)

    top_logprobs, top_ids = _branch(
        plan, needs, ("top_logprobs",), top_alternatives,
        lambda: (jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.float32),
                 jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.int32)),
    )
    return SamplerOutput(tokens, chosen, top_ids, top_logprobs, accepted)
