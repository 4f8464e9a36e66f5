"""The engine's statistics: an immutable snapshot, published by the engine thread after every step.

Readers (the HTTP server's metrics, admission, dashboards) take `engine.stats` as it is: replacing a reference
is atomic, so they never lock and never see half a step. Counters only grow; gauges are the state after the step.
Per-step facts are also summed into counters, so a reader sampling the snapshot at its own pace gets exact
totals over its interval (a dashboard's FLOPs per second, its decode batch sizes) without seeing every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.batching.kv_store import KVStoreCounters
from sluice.batching.scheduler import ScheduledChunk
from sluice.batching.sequence import Sequence
from sluice.batching.speculation import SpecCounters
from sluice.model.roofline import StepCost


@dataclass(frozen=True)
class StepStats:
    """One step: what ran, what it cost in FLOPs and bytes moved, and how long the engine thread spent on it:
    `duration_s` in all, from its dispatch (or, when it was dispatched while the step before ran, from that step's
    collection) to its collection, so the durations of consecutive steps never overlap and sum to the time the
    engine was stepping; of which `host_s` outside the device's step (scheduling, padding and dispatch before it,
    appending the sampled tokens after them; the text work in between overlaps the device).

    Decode rows are sequences computing their one new token (with their drafts, when speculating);
    everything else is prefill. A multi-step decode call counts its forward passes in `flops` and `bytes`.
    """

    num_tokens: int
    num_seqs: int
    num_decode_seqs: int
    num_prefill_tokens: int
    num_draft_tokens: int
    flops: float = 0.0
    bytes: float = 0.0
    duration_s: float = 0.0
    host_s: float = 0.0

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], limits: list[int] | None, cost: StepCost) -> StepStats:
        """Of the scheduled chunks, before their tokens are appended; `limits`: a multi-step call's decode
        steps per chunk (None for one step)."""
        decodes = [c for c in chunks if c.sample and c.num_tokens - c.num_drafts == 1]
        num_tokens = sum(c.num_tokens for c in chunks)
        decode_tokens = sum(c.num_tokens for c in decodes)
        drafts = sum(c.num_drafts for c in chunks)
        if limits is None:
            # A chunk's token at position p attends to p + 1 keys; the chunk reads its whole context once.
            attended = sum(c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2 for c in chunks)
            computed, passes, read = num_tokens, 1, sum(c.start + c.num_tokens for c in chunks)
        else:
            # One token per pass per row, each pass attending to (and reading) one more key than the last.
            attended = sum(n * (c.start + 1) + n * (n - 1) // 2 for c, n in zip(chunks, limits))
            computed, passes, read = sum(limits), max(limits), attended
        return cls(num_tokens, len(chunks), len(decodes), num_tokens - decode_tokens, drafts,
                   flops=cost.flops(computed, attended), bytes=cost.bytes(passes, read))


@dataclass(frozen=True)
class EngineStats:
    """Gauges count requests (a request is running while any of its sequences is), and sequences separately.
    `spec` is set when speculative decoding is on; `num_step_failures` counts steps that failed (every request in
    flight then ended with an error, and the engine started over); `prefix_store` is the persistent prefix
    store's counters, when there is one.

    Sums over all steps: `busy_s` (time spent stepping), `flops` and `bytes` (what the steps computed and
    moved), `decode_batch_steps[b]` (steps that decoded b sequences; b from 0 to max_num_seqs), and
    `queue_wait_s` over `num_admitted` (from entering the waiting queue to being scheduled, each time a
    sequence is admitted: a preempted sequence waits again).

    With LoRA adapters: `max_loras`, the device's LoRA slots (0 without), and the adapters of the running and of the
    waiting sequences, by name.
    """

    num_requests_running: int
    num_requests_waiting: int
    num_seqs_running: int
    num_seqs_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    last_step: StepStats | None
    num_step_failures: int = 0
    prefix_store: KVStoreCounters | None = None
    spec: SpecCounters | None = None
    busy_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    decode_batch_steps: tuple[int, ...] = ()
    queue_wait_s: float = 0.0
    num_admitted: int = 0
    max_loras: int = 0
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()


@dataclass
class StepTotals:
    """The engine thread's running sums behind `EngineStats`' summed fields (see there)."""

    max_num_seqs: int
    busy_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    queue_wait_s: float = 0.0
    num_admitted: int = 0
    decode_batch_steps: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.decode_batch_steps = [0] * (self.max_num_seqs + 1)

    def add_step(self, step: StepStats) -> None:
        self.busy_s += step.duration_s
        self.flops += step.flops
        self.bytes += step.bytes
        self.decode_batch_steps[step.num_decode_seqs] += 1

    def add_admitted(self, seqs: list[Sequence], now: float) -> None:
        self.queue_wait_s += sum(now - seq.queued_at for seq in seqs)
        self.num_admitted += len(seqs)
