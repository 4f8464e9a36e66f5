"""Sampler batches built from requests' parameters, for sampler tests: the engine's own `SamplingBatch.write`
for each row, plus the per-step fields."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.batching.sampler import SamplingBatch
from sluice.batching.sampling_params import SamplingParams


@dataclass(frozen=True)
class Row:
    """One row: its request's parameters and seed, the output index it samples, its tokens so far (prompt +
    output, the first `num_prompt` the prompt; kept only if its penalties read them), its stop ids, and a draft
    to verify (-1: none)."""

    params: SamplingParams
    seed: int = 0
    step: int = 0
    tokens: tuple[int, ...] = ()
    num_prompt: int = 0
    stop_ids: tuple[int, ...] = ()
    draft: int = -1


def sampling_batch(rows: list[Row], num_rows: int, vocab_size: int, history_len: int = 32, num_banned: int = 4
                   ) -> SamplingBatch:
    """Host arrays for `rows`, padded to `num_rows`."""
    batch = SamplingBatch.empty(num_rows, num_banned, history_len)
    for i, row in enumerate(rows):
        batch.write(i, row.params, row.seed, row.stop_ids, row.num_prompt, vocab_size)
        batch.step[i] = row.step
        batch.draft[i] = row.draft
        if row.params.reads_history:
            batch.history[i, :len(row.tokens)] = row.tokens
    return batch
