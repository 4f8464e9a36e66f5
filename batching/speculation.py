"""Speculative decoding policy: which sequences draft this step, from measured step costs and acceptance.

Drafts pay when verifying them costs less than the tokens they save. A step's time is modelled as
`a + b * padded tokens` (the step's compiled bucket: what the device really computes), fitted to the engine's own
decode and verify steps and seeded at start-up by timing a 1-row and a full decode step. A step of S decoding
sequences yields S tokens. Giving a sequence k drafts adds k tokens to the step (and maybe a larger bucket) and
`E` expected tokens, where `E = alpha (1 - alpha^k) / (1 - alpha)` for its recent per-draft acceptance `alpha`
(an exponential average, so a sequence whose drafts stop matching stops drafting; a new sequence starts from the
server's recent rate). A sequence left without drafts still has its first proposed token compared with the
token it then samples, so `alpha` keeps following what drafts would do and a sequence that starts copying
starts drafting. Sequences are ranked by E per draft, and the step drafts for the best prefix of that ranking by
expected tokens per second, none at all when that is best. A large batch, whose step is already compute-bound
(large `b*S` next to `a`), therefore drafts little or nothing; one stream with good drafts drafts. A single step
that also prefills drafts nothing (see `propose`).

How many drafts a sequence checks follows from the same costs: its i-th draft is kept with probability
`alpha^i` and adds one token's row to the step, which costs `b` against `a + b` for the token a lone sequence's
step yields, so the drafts that pay are those with `alpha^i >= b / (a + b)` (`paying_drafts`): all k while a
sequence copies, fewer as its drafts start missing, none below `b / (a + b)`.

When every running sequence decodes and none waits, the engine runs multi-step decode calls, and drafts ride
inside them (`propose_for_call` picks the sequences): at every step of the call the device proposes up to k
drafts for each drafting sequence from its tokens so far and checks those that pay, so one call verifies several
runs without the host in between. The same rule applies there with the steps of such calls' own fitted cost
(`multi_step_cost`: their steps cost less each, a smaller `a`), their tokens being the call's rows plus the
drafts a step checks, plus what such a call's step costs beyond a plain one's at that batch (`verify_overhead`,
measured at start-up: its sampler scores 1 + k rows per sequence). Within the call each drafting sequence's
acceptance is kept on the device, and at each step it checks the drafts that pay at its current acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from batching.ngram import NgramConfig
from batching.sequence import Sequence

ACCEPTANCE_SMOOTHING = 0.3
PRIOR_SMOOTHING = 0.05  # the server-wide rate a new sequence starts from follows many verifications
COST_DECAY = 0.98  # weight of older step times in the cost fit


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters: rows that drafted, draft tokens, accepted tokens, and accepted
    tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


@dataclass(frozen=True)
class CallDrafts:
    """Drafting in a multi-step decode call: each sequence's acceptance going in (None: it does not draft), and
    what a draft's row costs in tokens at a step of the call (`paying_drafts`' `draft_cost`)."""

    acceptance: list[float | None]
    draft_cost: float


def expected_accepted(alpha: float, k: int) -> float:
    """Expected accepted drafts out of k when each is accepted with probability alpha (until the first miss)."""
    return k if alpha >= 1.0 else alpha * (1 - alpha**k) / (1 - alpha)


def paying_drafts(acceptance, draft_cost: float, k: int):
    """How many of k drafts pay for their rows: draft i is kept with probability `acceptance**i` (each accepted
    with probability `acceptance`, in order until the first miss) and its row costs `draft_cost` tokens' worth of
    step time, so drafts pay up to the first i with `acceptance**i < draft_cost`. acceptance: a numpy scalar or a
    numpy or jax array [...] -> int [...]."""
    return (acceptance[..., None] ** np.arange(1, k + 1) >= draft_cost).sum(-1)


def per_draft_rate(num_accepted, num_checked):
    """The per-draft acceptance one verification shows: drafts are checked in order until the first rejection, so
    those reached (the accepted ones, and the rejected one if any) estimate it. Python or numpy ints, or jax
    arrays (elementwise; 0 where nothing was checked)."""
    reached = num_accepted + (num_accepted < num_checked)
    return num_accepted / (reached + (reached == 0))


def smoothed(average, value, weight: float = ACCEPTANCE_SMOOTHING):
    """An exponential average moved towards `value` by `weight` (floats or arrays)."""
    return average + weight * (value - average)


def draft_row_cost(cost: StepCostModel) -> float:
    """What a draft's row costs in tokens: `b` seconds, against `a + b` for the token of a lone sequence's step."""
    a, b = cost.coefficients()
    return b / (a + b)


@dataclass
class StepCostModel:
    """Least squares of step time on step tokens: the start-up measurements (`seed`), which never decay, and the
    engine's own steps (`observe`), older ones decaying. The seeds keep the slope known when the steps all have
    about the same size (a steady batch), which alone would leave it unidentified."""

    weight: float = 0.0
    sum_t: float = 0.0
    sum_tt: float = 0.0
    sum_y: float = 0.0
    sum_ty: float = 0.0
    seeds: list[tuple[float, float]] = field(default_factory=list)

    def seed(self, tokens: float, seconds: float) -> None:
        self.seeds.append((tokens, seconds))

    def observe(self, tokens: float, seconds: float, weight: float = 1.0) -> None:
        d = COST_DECAY
        self.weight = d * self.weight + weight
        self.sum_t = d * self.sum_t + weight * tokens
        self.sum_tt = d * self.sum_tt + weight * tokens * tokens
        self.sum_y = d * self.sum_y + weight * seconds
        self.sum_ty = d * self.sum_ty + weight * tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of `seconds = a + b * tokens`, both kept positive."""
        w = self.weight + len(self.seeds)
        t = self.sum_t + sum(x for x, _ in self.seeds)
        tt = self.sum_tt + sum(x * x for x, _ in self.seeds)
        y = self.sum_y + sum(v for _, v in self.seeds)
        ty = self.sum_ty + sum(x * v for x, v in self.seeds)
        var = tt * w - t**2
        if var <= 0:
            return max(y / max(w, 1e-9), 1e-6), 1e-6
        b = max((ty * w - t * y) / var, 1e-6)
        return max((y - b * t) / w, 1e-6), b


@dataclass
class Speculator:
    """`cost`: single decode and verify steps; `multi_step_cost`: one step inside a multi-step decode call (with
    or without drafts); `verify_overhead`: what a step of a multi-step call with drafts costs beyond that, by its
    compiled bucket's sequences (measured at start-up). `prior_acceptance`: the acceptance a new sequence starts
    from, the server's recent rate (0.5, the mean of a uniform prior, before any draft)."""

    config: NgramConfig
    cost: StepCostModel = field(default_factory=StepCostModel)
    multi_step_cost: StepCostModel = field(default_factory=StepCostModel)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    prior_acceptance: float = 0.5
    verify_overhead: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.config.num_speculative_tokens

    def propose(self, running: list[Sequence], max_model_len: int, padded: Callable[[int, bool], int],
                prefills: bool = False) -> None:
        """Sets `seq.drafts` for this (single) step on the decoding sequences (one token left to compute) worth
        it, and clears it on every other running sequence (a draft of an earlier step is stale once a sequence
        has more to compute: after a preemption, or tokens its grammar forced).

        `padded(tokens, with_drafts)`: the tokens the step's compiled bucket computes for that many tokens.
        `prefills`: the step will also prefill. It then drafts nothing: the fit knows decode and verify steps only,
        and such a step is compute-bound by its prefill while drafts multiply its sampled rows (measured at
        concurrency 32: 86 ms against 56 per step, RESULTS.md). Shadow drafts still follow acceptance.
        """
        self.clear(running)
        decoding = [seq for seq in running if seq.num_uncomputed_tokens == 1]
        proposals = {}
        for seq in decoding:
            room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens,
                       self.config.num_speculative_tokens + 1) - 1
            drafts = seq.proposer.propose(room) if seq.proposer is not None else []
            if seq.grammar is not None:
                drafts = seq.grammar.valid_prefix(drafts)  # a draft its grammar forbids would be rejected
            if drafts:
                proposals[seq] = drafts
        row_cost = draft_row_cost(self.cost)
        paying = {seq: drafts[:int(paying_drafts(np.float64(self.acceptance(seq)), row_cost, len(drafts)))]
                  for seq, drafts in proposals.items()}
        chosen = set() if prefills else self._choose(
            [(seq, len(d)) for seq, d in paying.items() if d], len(decoding), self.cost,
            padded(len(decoding), False), lambda drafts: padded(len(decoding) + drafts, True))
        for seq, drafts in proposals.items():
            if seq in chosen:
                seq.drafts = paying[seq]
            else:
                seq.shadow_draft = drafts[0]

    def propose_for_call(self, seqs: list[Sequence], padded: Callable[[int, bool], int]) -> CallDrafts | None:
        """Which sequences of a multi-step decode call draft in it (up to k drafts a step, proposed on the device
        from their tokens), None if none. Sequences whose penalties read their history never do: their drafts
        would need it. Within the call, a sequence checks at each step the drafts that pay at its acceptance."""
        k, rows, row_cost = self.config.num_speculative_tokens, padded(len(seqs), False), draft_row_cost(
            self.multi_step_cost)
        candidates = [(seq, int(paying_drafts(np.float64(self.acceptance(seq)), row_cost, k))) for seq in seqs
                      if seq.proposer is not None and not seq.sampling.reads_history]
        chosen = self._choose([c for c in candidates if c[1] > 0], len(seqs), self.multi_step_cost, rows,
                              lambda drafts: rows + drafts, self.verify_overhead.get(rows, 0.0))
        for seq, _ in candidates:
            if seq not in chosen and (drafts := seq.proposer.propose(1)):
                seq.shadow_draft = drafts[0]
        if not chosen:
            return None
        return CallDrafts([self.acceptance(seq) if seq in chosen else None for seq in seqs], row_cost)

    @staticmethod
    def clear(running: list[Sequence]) -> None:
        for seq in running:
            seq.drafts = []

    def acceptance(self, seq: Sequence) -> float:
        """The sequence's recent per-draft acceptance; before any evidence, that of the server's recent drafts."""
        return self.prior_acceptance if seq.acceptance is None else seq.acceptance

    def _choose(self, candidates: list[tuple[Sequence, int]], num_decoding: int, cost: StepCostModel,
                plain_tokens: int, tokens_with: Callable[[int], int], overhead: float = 0.0) -> set[Sequence]:
        """Of the candidates (a sequence, and the drafts a step would check for it), those to draft for: the best
        prefix, by expected tokens per second of a step, of their ranking by expected accepted tokens per draft.
        A step of the `num_decoding` sequences computes `plain_tokens` tokens without drafts and `tokens_with(d)`
        with d drafts, and then costs `overhead` seconds more."""
        a, b = cost.coefficients()
        gain = lambda seq, num_drafts: expected_accepted(self.acceptance(seq), num_drafts)
        ranked = sorted(candidates, key=lambda c: -gain(*c) / c[1])
        best, best_rate = 0, num_decoding / (a + b * plain_tokens)
        checked, expected = 0, float(num_decoding)
        for count, (seq, num_drafts) in enumerate(ranked, 1):
            checked += num_drafts
            expected += gain(seq, num_drafts)
            rate = expected / (a + b * tokens_with(checked) + overhead)
            if rate > best_rate:
                best, best_rate = count, rate
        return {seq for seq, _ in ranked[:best]}

    def check_shadow(self, seq: Sequence, token: int) -> None:
        """The token a sequence sampled without drafts: was it the draft it would have verified first?"""
        if seq.shadow_draft is not None:
            self._update_acceptance(seq, float(token == seq.shadow_draft))
            seq.shadow_draft = None

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a verify step: `num_accepted` of the sequence's `num_drafts` drafts were accepted."""
        if num_drafts:
            self._update_acceptance(seq, self.count(num_drafts, num_accepted))

    def count(self, num_drafts: int, num_accepted: int) -> float:
        """Counts one verification of `num_drafts` > 0 drafts, the server-wide rate following it; returns its
        per-draft acceptance (a multi-step call keeps its sequences' own rates on the device)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        rate = per_draft_rate(num_accepted, num_drafts)
        self.prior_acceptance = smoothed(self.prior_acceptance, rate, PRIOR_SMOOTHING)
        return rate

    def _update_acceptance(self, seq: Sequence, rate: float) -> None:
        seq.acceptance = smoothed(self.acceptance(seq), rate)

    def counters(self) -> SpecCounters:
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            tuple(self.accepted_per_position))
