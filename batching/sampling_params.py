"""Per-request generation parameters (the engine's side of an OpenAI request)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    `seed` makes the request's samples reproducible whatever else shares its batch.
    `logprobs` asks for the chosen token's log-probability; `top_logprobs` (0..20) for the k best.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    priority: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be between 0 and max_tokens"),
            (0.0 <= self.temperature <= 2.0, "temperature", "must be between 0 and 2"),
            (self.top_k >= 0 or self.top_k == -1, "top_k", "must be -1, 0 or positive"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}"),
            (self.n >= 1, "n", "must be at least 1"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
