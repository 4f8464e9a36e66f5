"""One sequence's state: its tokens, how many of them have K/V in the pool, and which pages hold them.

A request with `n` > 1 becomes n sequences (index 0..n-1) that share the request id and, once the first has
prefilled the prompt, the prompt's full pages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batching.request_output import FinishReason
from batching.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`token_ids` is prompt + output; tokens [0, num_computed_tokens) have their K/V in `page_table`'s pages.

    `seed` keys the sampler (folded with the output step), so a sequence draws the same samples whatever
    shares its batch and after a preemption. `arrival` orders first-come-first-served scheduling.
    """

    seq_id: int
    request_id: str
    index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival: int
    parent: Sequence | None = None
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def schedule_key(self) -> tuple[int, int, int]:
        """Lower runs first: priority (lower value = more urgent), then arrival, then index within the request."""
        return (self.params.priority, self.arrival, self.index)
