"""The engine's statistics: an immutable snapshot, published by the engine thread after every step.

Readers (the HTTP server's metrics, admission, dashboards) take `engine.stats` as it is: replacing a reference
is atomic, so they never lock and never see half a step. Counters only grow; gauges are the state after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from batching.scheduler import ScheduledChunk
from batching.speculation import SpecCounters


@dataclass(frozen=True)
class StepStats:
    """One step: what ran and how long the engine thread spent on it (host work and device time).

    Decode rows are sequences computing their one new token (with their drafts, when speculating);
    everything else is prefill.
    """

    num_tokens: int
    num_seqs: int
    num_decode_seqs: int
    num_prefill_tokens: int
    num_draft_tokens: int
    duration_s: float = 0.0

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> StepStats:
        """Of the scheduled chunks, before their tokens are appended."""
        decodes = [c for c in chunks if c.sample and c.num_tokens - c.num_drafts == 1]
        num_tokens = sum(c.num_tokens for c in chunks)
        decode_tokens = sum(c.num_tokens for c in decodes)
        drafts = sum(c.num_drafts for c in chunks)
        return cls(num_tokens, len(chunks), len(decodes), num_tokens - decode_tokens, drafts)


@dataclass(frozen=True)
class EngineStats:
    """Gauges count requests (a request is running while any of its sequences is), and sequences separately.
    `spec` is set when speculative decoding is on."""

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
    spec: SpecCounters | None = None
