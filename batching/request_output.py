"""What the engine streams back for a request: one `RequestOutput` per step that produced tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one sampled token, with the `top_logprobs` best alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    """An increment of one sequence (`index` among the request's `n`).

    `text` and `token_ids` hold only what is new since the previous output of this index;
    `finish_reason` is set on the last one, and `usage` then counts the whole request.
    `error` carries a message when the request failed inside the engine.
    """

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
