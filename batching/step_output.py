"""A dispatched step's results on their way to the host, and each scheduled sequence's share of them, whatever
ran: one step, a multi-step call or a verification (`device_step.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from typing import Any, NamedTuple

import jax
import numpy as np

from sluice.batching.device_step import Bucket, PromptScores, VerifiedSteps
from sluice.batching.faults import strike
from sluice.batching.sampler import SamplerOutput
from sluice.batching.scheduler import ScheduledChunk


class SequenceOutput(NamedTuple):
    """What one scheduled sequence got from a step, whatever ran (one step, a multi-step call, a verification):
    its new tokens in order, where each lies in the sampler's output (`positions`, (step, row): its logprobs),
    and (drafts checked, drafts accepted) of each verification. The engine stops taking tokens where the
    sequence ends. `finite` is False if its row sampled nothing (its logits were not finite, NaN or inf, or its
    masks left it no token): it then has no tokens."""

    tokens: list[int]
    positions: list[tuple[int, int]]
    verifications: list[tuple[int, int]]
    finite: bool = True


_NONFINITE = SequenceOutput([], [], [], finite=False)


class StepOutput:
    """A step's results on the host: the sampler's arrays (numpy, leading [num_steps] axis; `top_ids` and
    `top_logprobs` None unless a sequence wants logprobs, `accepted` None unless one drafted; row i is chunk i's
    first when no chunk drafts), each chunk's share of them (`share`), `pooled` ([S, D] float32, row i chunk
    i's sum of its pooled tokens' final hidden states) when the step pools, and `scores` (`PromptScores`, numpy,
    a row per token of the step) when it scores prompt tokens."""

    def __init__(self, out: SamplerOutput | VerifiedSteps, chunks: list[ScheduledChunk], rows: list[int],
                 limits: list[int] | None, pooled: np.ndarray | None, scores: PromptScores | None) -> None:
        """`rows`: each chunk's first sampled row."""
        self.sampled = out.sampled if isinstance(out, VerifiedSteps) else out
        self.pooled = pooled
        self.scores = scores
        self._out = out
        self._chunks, self._rows, self._limits = chunks, rows, limits

    @cached_property
    def nonfinite(self) -> np.ndarray:
        """[rows] bool: whether a row sampled nothing (its logprob is not finite: `sample`) at any step of the call
        (a multi-step call zeroes the logprobs of rows past their end, which compute padding)."""
        return ~np.isfinite(self.sampled.logprobs).all(axis=0)

    @cached_property
    def _by_row(self) -> list[list[int]]:
        return self.sampled.tokens.T.tolist()  # [rows][steps], in one call

    def runs(self) -> tuple[list[list[int]], list[bool]]:
        """For a step in which no chunk drafts (row i is chunk i's): each chunk's tokens of every step, and whether
        it sampled nothing."""
        n = len(self._chunks)
        return self._by_row[:n], self.nonfinite[:n].tolist()

    def share(self, i: int) -> SequenceOutput | None:
        """Chunk i's share: None for a chunk that samples nothing (a prefill not yet at its end). A plain run's
        positions are listed only if its sequence wants logprobs (nothing else reads them)."""
        chunk, row, out = self._chunks[i], self._rows[i], self._out
        if not chunk.sample:
            return None
        if isinstance(out, VerifiedSteps):
            return self._verified(i, row, out)
        if self.nonfinite[row]:
            return _NONFINITE
        if chunk.num_drafts:
            accepted = int(np.cumprod(out.accepted[0, row:row + chunk.num_drafts]).sum())
            # The accepted drafts, then one sampled, up to a row that sampled nothing (its masks left it no token):
            # the next step samples there again.
            finite = np.isfinite(out.logprobs[0, row:row + accepted + 1])
            kept = accepted + 1 if finite.all() else int(np.argmin(finite))
            positions = [(0, r) for r in range(row, row + kept)]
            return SequenceOutput([int(out.tokens[p]) for p in positions], positions, [(chunk.num_drafts, accepted)])
        tokens = self._by_row[row] if self._limits is None else self._by_row[row][:self._limits[i]]
        positions = [(s, row) for s in range(len(tokens))] if chunk.seq.params.wants_logprobs else []
        return SequenceOutput(tokens, positions, [])

    def _verified(self, i: int, row: int, out: VerifiedSteps) -> SequenceOutput:
        """Chunk i's share of a speculative multi-step call: its 1 + k rows from `row` at every step. A kept row not
        finite, any of them and not only the first, voids the call's tokens, as in a multi-step decode: the steps
        after it ran on its token (`verify_steps` zeroes the rows it does not keep)."""
        width = out.sampled.tokens.shape[1] // out.num_emitted.shape[1]
        if self.nonfinite[row:row + width].any():
            return _NONFINITE
        positions, verifications = [], []
        for step in range(out.num_emitted.shape[0]):
            kept = int(out.num_emitted[step, i])
            positions += [(step, r) for r in range(row, row + kept)]
            if checked := int(out.num_verified[step, i]):
                accepted = int(np.cumprod(out.sampled.accepted[step, row:row + checked]).sum())
                verifications.append((checked, accepted))
        return SequenceOutput([int(out.sampled.tokens[p]) for p in positions], positions, verifications)


class PendingStep:
    """A dispatched step whose sampled tokens are being copied to the host."""

    def __init__(self, out: SamplerOutput | VerifiedSteps | Callable[[], SamplerOutput], chunks: list[ScheduledChunk],
                 rows: list[int], limits: list[int] | None, drafting: list[int] | None, pooled: jax.Array | None,
                 scores: PromptScores | None, bucket: Bucket, fault: str | None = None):
        """`out`: the sampler's, or (a step whose grammar masks wait for the step before it) the call that fills
        them and samples, which `sample` makes. `limits`, `drafting`: the multi-step call's that ran
        (`ModelRunner.dispatch`), None for a single step; `bucket`: the step's shape, for a hung step's report;
        `fault`: an injected one (`faults.py`)."""
        self.chunks, self.rows, self.limits, self.drafting = chunks, rows, limits, drafting
        self._sampling = out if callable(out) else None
        self._out = (None if callable(out) else self._read(out), pooled, scores)
        self.bucket = bucket
        self._fault = fault
        _copy_to_host(self._out)

    def sample(self) -> None:
        """Fills the step's grammar masks (from its sequences' matchers as they are now) and dispatches its
        sampling, if it waited for that."""
        if self._sampling is not None:
            sampling, self._sampling = self._sampling, None
            self._out = (self._read(sampling()), *self._out[1:])
            _copy_to_host(self._out[0])

    def _read(self, out: SamplerOutput | VerifiedSteps) -> SamplerOutput | VerifiedSteps:
        """What of `out` the host reads: a single step's top alternatives only for logprobs, and its acceptances
        only for drafts."""
        if self.drafting is not None:
            return out
        logprobs = any(c.seq.params.wants_logprobs for c in self.chunks)
        return replace(out, top_ids=out.top_ids if logprobs else None,
                       top_logprobs=out.top_logprobs if logprobs else None,
                       accepted=out.accepted if any(c.num_drafts for c in self.chunks) else None)

    def fetch(self) -> StepOutput:
        """Blocks until the step is done."""
        self.sample()
        strike(self._fault, self.bucket)
        out, pooled, scores = jax.tree.map(np.asarray, self._out)
        return StepOutput(out, self.chunks, self.rows, self.limits, pooled, scores)


def _copy_to_host(tree: Any) -> None:
    for leaf in jax.tree.leaves(tree):
        leaf.copy_to_host_async()
