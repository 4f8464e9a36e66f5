"""Speculative decoding policy: which decoding sequences draft this step, and how many drafts each checks.

A sequence's n-gram drafts (`ngram.py`) are checked in the step that samples its next token: its last token and
its drafts run as one causal query, and the drafts are kept up to the first the sampler rejects. The policy is
what the measurements in RESULTS.md (speculative decoding) support, and no more:
- a fixed draft length k (`--num-speculative-tokens`);
- a per-sequence acceptance average `alpha` (exponential, over its verifications' per-draft rates; 0.5 before
  any), from which `drafts_worth_checking` takes how many of the k drafts pay: all k while a sequence copies, fewer
  as its drafts start missing or the batch grows (it beat checking all k or none on copy-heavy requests one at a
  time). A sequence that drafts nothing still has its first proposed token compared with the token it samples
  (`shadow_draft`), so `alpha` keeps following what its drafts would do;
- a batch-size cutoff: with more than `max_batch_size` decoding sequences nobody drafts. A large batch's step is
  compute-bound, and a step that checks drafts costs more than its rows (its sampler scores 1 + k rows per
  sequence), so drafts stop paying at a few sequences on a CPU.
A single step that also prefills drafts nothing: its sampled rows would multiply. Inside multi-step decode calls
the device proposes and checks drafts at every step (`device_step.verify_steps`), each drafting sequence up to
the count chosen here when the call starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.batching.ngram import NgramConfig
from sluice.batching.sequence import Sequence

INITIAL_ACCEPTANCE = 0.5
ACCEPTANCE_SMOOTHING = 0.3


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters: rows that drafted, draft tokens, accepted tokens, and accepted
    tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


def per_draft_rate(num_accepted: int, num_checked: int) -> float:
    """The per-draft acceptance one verification shows: drafts are checked in order until the first rejection,
    so those reached (the accepted ones, and the rejected one if any) estimate it."""
    reached = num_accepted + (num_accepted < num_checked)
    return num_accepted / reached if reached else 0.0


def drafts_worth_checking(acceptance: float, k: int, batch_size: int, row_cost: float) -> int:
    """Of k drafts, how many a sequence with this per-draft acceptance checks in a step of `batch_size` decoding
    sequences, where one more row costs `row_cost` of a lone sequence's step: draft i is kept with probability
    `acceptance^i`, against the share of the step's time one of its tokens costs, `c S / (1 - c + c S)`."""
    token_share = row_cost * batch_size / (1 - row_cost + row_cost * batch_size)
    return sum(acceptance**i >= token_share for i in range(1, k + 1))


class Speculator:
    """Chooses drafts for the engine and keeps the counters and each sequence's acceptance."""

    def __init__(self, config: NgramConfig):
        self.config = config
        self._totals = SpecCounters(accepted_per_position=(0,) * config.num_speculative_tokens)

    def draft_count(self, seq: Sequence, batch_size: int) -> int:
        """How many drafts the sequence checks this step; with none, its first proposal becomes its shadow."""
        acceptance = INITIAL_ACCEPTANCE if seq.acceptance is None else seq.acceptance
        count = drafts_worth_checking(acceptance, self.config.num_speculative_tokens, batch_size,
                                      self.config.row_cost)
        if not count and (drafts := seq.proposer.propose(1)):
            seq.shadow_draft = drafts[0]
        return count

    def propose(self, running: list[Sequence], max_model_len: int, prefills: bool) -> None:
        """Sets `seq.drafts` for a single step on the decoding sequences (one token left to compute), and clears
        it on every other running sequence (a draft of an earlier step is stale once a sequence has more to
        compute: after a preemption, or tokens its grammar forced). `prefills`: the step also prefills."""
        self.clear(running)
        decoding = [seq for seq in running if seq.num_uncomputed_tokens == 1]
        if prefills or len(decoding) > self.config.max_batch_size:
            return
        for seq in (seq for seq in decoding if seq.proposer is not None):
            room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens,
                       self.draft_count(seq, len(decoding)) + 1) - 1
            drafts = seq.proposer.propose(room)
            # A draft its grammar forbids would be rejected.
            seq.drafts = seq.grammar.valid_prefix(drafts) if seq.grammar is not None else drafts

    def propose_for_call(self, seqs: list[Sequence]) -> list[int] | None:
        """For a multi-step decode call, the most drafts each sequence checks at a step of it (0: it does not
        draft), None if none drafts. Sequences whose penalties read their history never do: their drafts would
        need it on the device."""
        if len(seqs) > self.config.max_batch_size:
            return None
        counts = [self.draft_count(seq, len(seqs)) if seq.proposer is not None and not seq.params.reads_history
                  else 0 for seq in seqs]
        return counts if any(counts) else None

    @staticmethod
    def clear(running: list[Sequence]) -> None:
        for seq in running:
            seq.drafts = []
            seq.shadow_draft = None

    def record(self, seq: Sequence, num_checked: int, num_accepted: int) -> None:
        """One verification: `num_accepted` of the sequence's `num_checked` > 0 drafts were accepted."""
        totals = self._totals
        self._totals = SpecCounters(totals.num_drafts + 1, totals.num_draft_tokens + num_checked,
                                   totals.num_accepted_tokens + num_accepted,
                                   tuple(n + (p < num_accepted) for p, n in enumerate(totals.accepted_per_position)))
        self._update_acceptance(seq, per_draft_rate(num_accepted, num_checked))

    def check_shadow(self, seq: Sequence, token: int) -> None:
        """The first token a sequence sampled without drafts: was it the draft it would have checked first?"""
        if seq.shadow_draft is not None:
            self._update_acceptance(seq, float(token == seq.shadow_draft))
            seq.shadow_draft = None

    @staticmethod
    def _update_acceptance(seq: Sequence, rate: float) -> None:
        average = INITIAL_ACCEPTANCE if seq.acceptance is None else seq.acceptance
        seq.acceptance = average + ACCEPTANCE_SMOOTHING * (rate - average)

    def counters(self) -> SpecCounters:
        return self._totals
