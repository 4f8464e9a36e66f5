"""N-gram prompt lookup: draft tokens for speculative decoding from the sequence's own prompt and output.

For the longest recent suffix (n from `max_n` down to `min_n`) that occurred earlier in the sequence, propose
the tokens that followed its latest earlier occurrence. The index is incremental: each appended token records
the n-grams ending just before it, so a proposal costs O(max_n) dictionary lookups whatever the context length.
`propose_on_device` is the same proposal for a batch of token histories, jittable, for drafts proposed inside
a multi-step call (one pass over each history per n: a few microseconds for 4k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class NgramConfig:
    """Speculative decoding's settings: up to `num_speculative_tokens` drafts continuing a matched suffix of
    `min_n`..`max_n` tokens, while at most `max_batch_size` sequences decode (`speculation.py`). `row_cost`: what
    one more row costs next to a lone sequence's step (b / (a + b) of a step taking a + b * rows), as measured on
    a 2-core CPU (RESULTS.md, speculative decoding)."""

    num_speculative_tokens: int = 4
    min_n: int = 1
    max_n: int = 4
    max_batch_size: int = 4
    row_cost: float = 0.1


@dataclass
class NgramProposer:
    """One sequence's n-gram index over its tokens: `follows[ngram]` is where the latest occurrence of that
    n-gram (followed by at least one token) ends."""

    config: NgramConfig
    tokens: list[int] = field(default_factory=list)
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            end = len(self.tokens)  # the n-grams ending here are followed by `token`
            for n in range(self.config.min_n, min(self.config.max_n, end) + 1):
                self.follows[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts continuing the longest matched suffix."""
        end = len(self.tokens)
        if max_tokens <= 0:
            return []
        for n in range(min(self.config.max_n, end - 1), self.config.min_n - 1, -1):
            start = self.follows.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self.tokens[start:start + max_tokens]
        return []


def propose_on_device(history: jax.Array, config: NgramConfig) -> tuple[jax.Array, jax.Array]:
    """history: [S, H] int32, each row's tokens then -1 -> (drafts [S, k] int32, num_drafts [S] int32): row s's
    first num_drafts[s] drafts are `NgramProposer.propose(k)` over its tokens (k = num_speculative_tokens)."""
    num_rows, width = history.shape
    length = jnp.sum(history >= 0, axis=1)
    ends = jnp.arange(width)  # an occurrence ending just before position `end`, followed by the token at `end`
    padded = jnp.pad(history, ((0, 0), (config.max_n, 0)), constant_values=-1)
    best = jnp.full(num_rows, -1, jnp.int32)
    for n in range(config.min_n, config.max_n + 1):  # a longer match overrides a shorter one
        suffix = jnp.take_along_axis(history, jnp.maximum(length[:, None] - n + jnp.arange(n), 0), axis=1)
        matches = (ends >= n) & (ends < length[:, None]) & (length[:, None] > n)
        for i in range(n):
            shift = config.max_n - n + i  # padded[:, shift + end] is history[:, end - n + i]
            matches &= padded[:, shift:shift + width] == suffix[:, i:i + 1]
        latest = jnp.max(jnp.where(matches, ends, -1), axis=1)
        best = jnp.where(latest >= 0, latest, best)
    k = config.num_speculative_tokens
    drafts = jnp.take_along_axis(history, jnp.clip(best[:, None] + jnp.arange(k), 0, width - 1), axis=1)
    num_drafts = jnp.where(best >= 0, jnp.clip(length - best, 0, k), 0)
    return drafts, num_drafts.astype(jnp.int32)
