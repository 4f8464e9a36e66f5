"""One sequence's state: its tokens, its pages, and everything that decides its next token and its text.

A request with several prompts or `n` > 1 has one sequence per choice (`choice = prompt * n + sample`); the
samples of one prompt share the prompt's full pages once the first of them (their `parent`) has prefilled it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.batching.ngram import NgramProposer
from sluice.batching.outputs import FinishReason, TokenLogprob
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.stop_checker import StopChecker

if TYPE_CHECKING:
    import numpy as np

    from sluice.batching.kv_store import StoredPrefix
    from sluice.batching.structured import Grammar


PENDING = -1  # a token still on the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Slots: a decode step reads hundreds of sequences, each out of cache after the device's step on a CPU; without a
# __dict__ one takes fewer cache lines (5-9% of the host's step at 256 sequences, RESULTS.md).
@dataclass(eq=False, slots=True)
class Sequence:
    """`token_ids` is prompt + output; tokens [0, num_computed_tokens) have their K/V in `page_table`'s pages.

    `seed` keys its draws (folded with the output step, so it samples the same tokens whatever shares its batch and
    after a preemption); `slot` is its row of the runner's persistent input batch while it runs (the scheduler's to
    give, -1 when it holds none), and `lora_slot` the device slot of its LoRA adapter's weights
    (`batching.lora_slots`; -1 when it holds none: no adapter, or not running); `stop` turns its tokens into text
    and decides when it ends (its count of output tokens is where the next text starts); `logprobs` are those of its
    tokens not yet emitted, when it wants them; `prompt_logprobs`, while it wants them and has not sent them, those
    of its prompt's tokens (None for the first, and for those not scored yet); `grammar` (structured output) is
    where its output stands in the grammar it must follow. `arrival` orders first-come-first-served scheduling;
    `queued_at` is when it last entered the waiting queue (`time.perf_counter()`). With speculative decoding,
    `proposer` drafts from the sequence's own tokens, `drafts` are this step's drafts, `shadow_draft` the first
    token it would have drafted when it drafts none, and `acceptance` the recent per-draft rate at which they are
    (or would be) accepted (None before any). `page_chain` holds its first full pages' (key, hash) in the prefix
    cache (`BlockManager._keys`, made as needed), of which the first `num_committed_pages` of its page table are
    there (registered, or found there at its admission). With a persistent prefix store, `store_keys` are its first full
    pages' keys there (`kv_store.KVLayout.page_keys`, computed as needed), of which the first `num_stored_pages`
    have gone to the store or were found there (a failure takes them out of it); `stored_prefix` is the read of its
    stored pages while it waits (`BlockManager.prefetch`).
    `pooled` ([hidden] float32) is an embedding's sum so far of its pooled tokens' final hidden states.
    """

    request_id: str
    choice: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    stop: StopChecker
    max_num_tokens: int
    slot: int = -1
    lora_slot: int = -1
    arrival: int = 0
    queued_at: float = 0.0
    parent: Sequence | None = None
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_pending: int = 0
    page_table: list[int] = field(default_factory=list)
    num_committed_pages: int = 0
    page_chain: list[tuple[tuple[int, tuple[int, ...]], int]] = field(default_factory=list)  # (CacheKey, hash)
    num_cached_tokens: int | None = None
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: Grammar | None = None
    proposer: NgramProposer | None = None
    drafts: list[int] = field(default_factory=list)
    shadow_draft: int | None = None
    acceptance: float | None = None
    store_keys: list[str] = field(default_factory=list)
    num_stored_pages: int = 0
    stored_prefix: StoredPrefix | None = None
    pooled: np.ndarray | None = None
    schedule_key: tuple[int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.arrive(self.arrival, self.queued_at)

    @property
    def computes_every_token(self) -> bool:
        """Whether it needs every prompt token's hidden state (an embedding's mean) or logits (its prompt's
        logprobs, not sent yet), so it takes no page from the prefix cache, the store or its request's first
        sequence."""
        return self.params.pooling == "mean" or self.prompt_logprobs is not None

    def arrive(self, arrival: int, now: float) -> None:
        """Enters the engine `arrival`-th, at `now`. Its `schedule_key` (lower runs first): priority (lower value =
        more urgent), then arrival, then choice within the request; kept, not derived, as the scheduler orders
        its queues by it."""
        self.arrival, self.queued_at = arrival, now
        self.schedule_key = (self.params.priority, arrival, self.choice)

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
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def at_limit(self) -> bool:
        """Whether every token it may have is known or pending: nothing more to compute."""
        return len(self.token_ids) >= self.max_num_tokens

    def add_pending(self, count: int) -> int:
        """Appends `count` placeholders; returns the index of the first."""
        index = len(self.token_ids)
        self.token_ids.extend([PENDING] * count)
        self.num_pending += count
        return index

    def place(self, index: int, tokens: list[int]) -> None:
        """Writes tokens the device sampled from `index` on: over their placeholders, the rest appended."""
        over = max(0, min(len(tokens), len(self.token_ids) - index))
        self.token_ids[index:index + over] = tokens[:over]
        self.num_pending -= over
        self.token_ids.extend(tokens[over:])

    def truncate(self, length: int) -> None:
        """Drops every token from `length` on, placeholders included."""
        removed = len(self.token_ids) - length
        del self.token_ids[length:]
        self.num_pending = max(0, self.num_pending - removed)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
