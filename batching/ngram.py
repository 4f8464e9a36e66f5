"""N-gram prompt lookup: draft tokens for speculative decoding from the sequence's own prompt and output.

For the longest recent suffix (n from `max_n` down to `min_n`) that occurred earlier in the sequence, propose
the tokens that followed its latest earlier occurrence. The index is incremental: each appended token records
the n-grams ending just before it, so a proposal costs O(max_n) dictionary lookups whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NgramConfig:
    num_speculative_tokens: int = 4
    min_n: int = 1
    max_n: int = 4


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
        """Up to `max_tokens` (and num_speculative_tokens) drafts continuing the longest matched suffix."""
        limit = min(max_tokens, self.config.num_speculative_tokens)
        end = len(self.tokens)
        if limit <= 0:
            return []
        for n in range(min(self.config.max_n, end - 1), self.config.min_n - 1, -1):
            start = self.follows.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self.tokens[start:start + limit]
        return []
