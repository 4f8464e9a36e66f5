"""Who runs this step: iteration-level scheduling under a token budget.

Each step takes running decodes first (with their draft tokens when speculating, as far as budget and pages
allow), then continues partial prefills, then admits waiting sequences (first come first served, lower
`priority` value first), chunking prefills to fit `max_num_batched_tokens`. A waiting sequence with a LoRA adapter
is admitted only into a LoRA slot (`LoraSlots.find`, taken by `acquire` once it is admitted); when none is free, or
its adapter's weights are being read again, it waits and the others are looked at, as vLLM's scheduler does; one
that finds every slot in use drains a slot for the rest of the pass, which no sequence after it joins.
When the pool runs out of pages, the newest running sequence is preempted: its pages are freed and it is
recomputed from its tokens later (its full pages usually survive in the prefix cache).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from operator import attrgetter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field

import numpy as np

from sluice.batching.block_manager import BlockManager
from sluice.batching.lora_slots import LoraSlots
from sluice.batching.sequence import Sequence, SequenceStatus


STORE_READ_WAIT_S = 0.05


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(slots=True)  # not frozen: a frozen dataclass costs a microsecond more to build, per sequence and step
class ScheduledChunk:
    """`seq` computes positions [start, start + num_tokens) this step: its tokens from `start`, then its first
    `num_drafts` draft tokens (speculative decoding). `sample` when that reaches its last token. Not changed
    after it is built."""

    seq: Sequence
    start: int
    num_tokens: int
    num_drafts: int = 0
    sample: bool = field(init=False)

    def __post_init__(self) -> None:
        # Fixed when scheduled: the sequence grows placeholders once its step is dispatched.
        self.sample = self.start + self.num_tokens - self.num_drafts == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        end = self.start + self.num_tokens - self.num_drafts
        return self.seq.token_ids[self.start:end] + self.seq.drafts[:self.num_drafts]

    @property
    def num_scored(self) -> int:
        """How many of its first tokens score the prompt token after them (`SamplingParams.prompt_logprobs`):
        prompt positions before the prompt's last, whose logits sample the first output token instead."""
        if self.seq.prompt_logprobs is None:
            return 0
        return max(0, min(self.start + self.num_tokens, len(self.seq.prompt_ids) - 1) - self.start)


def scored_rows(chunks: list[ScheduledChunk]) -> Iterator[tuple[ScheduledChunk, slice]]:
    """Each chunk that scores prompt tokens, with the rows of the step's flat tokens that score them (its first
    `num_scored`)."""
    for chunk, begin in zip(chunks, itertools.accumulate((c.num_tokens for c in chunks), initial=0)):
        if n := chunk.num_scored:
            yield chunk, slice(begin, begin + n)


@dataclass
class SchedulerOutput:
    """This step's chunks; the sequences sent back to waiting, and those moved from waiting to running."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)


_schedule_key = attrgetter("schedule_key")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, lora_slots: LoraSlots | None = None):
        """`lora_slots`: the model's LoRA slots (None: it serves no adapter)."""
        self.config = config
        self.block_manager = block_manager
        self.lora_slots = lora_slots
        # Both in `Sequence.schedule_key` order, kept as sequences come and go: a queue of thousands costs a step
        # no sort and no scan (RESULTS.md, 2026-11-29).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._waiting_requests: Counter[str] = Counter()  # request id -> its sequences in `waiting`
        self._free_slots = list(range(config.max_num_seqs))[::-1]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queues `seq` (new, or preempted: holding no pages) to wait for admission."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_schedule_key)
        self._waiting_requests[seq.request_id] += 1
        self.block_manager.prefetch(seq)

    def num_requests(self) -> tuple[int, int]:
        """(requests with a sequence running, requests with a sequence waiting and none running)."""
        running = {seq.request_id for seq in self.running}
        waiting = len(self._waiting_requests) - sum(request_id in self._waiting_requests for request_id in running)
        return len(running), waiting

    def finish(self, seq: Sequence) -> None:
        """Removes `seq` wherever it is, drops its placeholders and frees its pages now."""
        seq.truncate(seq.num_known_tokens)
        if seq.status is SequenceStatus.RUNNING:
            self._leave_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._leave_waiting(self._waiting_index(seq))
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Sequence, ScheduledChunk] = {}
        bm = self.block_manager

        # Decodes (one token left) before partial prefills, each group in schedule order.
        running = list(self.running)  # a copy: the loop preempts
        prefilling = [seq for seq in running if seq.num_uncomputed_tokens > 1]
        if prefilling:
            running = [seq for seq in running if seq.num_uncomputed_tokens <= 1] + prefilling
        for position, seq in enumerate(running):
            if seq.status is not SequenceStatus.RUNNING or seq.at_limit:
                continue  # preempted earlier in this loop, or its last token is still on the device
            if budget == 0:
                break
            start = seq.num_computed_tokens
            num_new = min(seq.num_uncomputed_tokens, budget)
            end = start + num_new
            if end > len(seq.page_table) * bm.page_size:  # most decode steps fill a page they hold
                budget += self._make_room(seq, end, scheduled, out)
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # preempted itself: no newer sequence was left to preempt
                bm.grow(seq, end)
            # Drafts take only what leaves a token for each sequence after it: they never starve one.
            later = len(running) - position - 1
            num_drafts = (min(len(seq.drafts), budget - num_new - later) if seq.drafts and end == seq.num_tokens
                          else 0)
            if num_drafts > 0 and bm.can_grow(seq, end + num_drafts):
                bm.grow(seq, end + num_drafts)
            else:
                num_drafts = 0  # drafts never preempt anyone
            scheduled[seq] = ScheduledChunk(seq, start, num_new + num_drafts, num_drafts)
            budget -= num_new + num_drafts

        if not out.preempted:
            self._admit(budget, scheduled, out)
        out.chunks = list(scheduled.values())
        if not out.chunks and not self.running:  # maybe pages or adapters' weights being read: wait, not spin
            reads = [s.stored_prefix.payloads for s in self.waiting if s.stored_prefix is not None]
            reads += self.lora_slots.reads.values() if self.lora_slots is not None else []
            wait(reads, timeout=STORE_READ_WAIT_S, return_when=FIRST_COMPLETED)
        return out

    def _admit(self, budget: int, scheduled: dict[Sequence, ScheduledChunk], out: SchedulerOutput) -> None:
        bm = self.block_manager
        if self.lora_slots is not None:
            self.lora_slots.begin_pass()
        i = 0  # the first waiting sequence not yet looked at: those admitted leave the list
        while i < len(self.waiting) and budget and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            parent = seq.parent
            if parent is not None and not parent.finished and parent.num_computed_tokens < parent.num_prompt_tokens:
                i += 1
                continue  # a sibling waits for the first sequence to prefill the prompt it will share
            lora = seq.params.lora
            lora_slot = -1 if lora is None else self.lora_slots.find(lora)  # taken (`acquire`) once admitted
            if lora_slot is None:
                i += 1
                continue  # every LoRA slot holds another adapter, which running sequences use, or its weights are read
            shared, stored = bm.match_prefix(seq)
            if stored is None:
                i += 1
                continue  # its pages are still being read from the store
            fork = self._fork_pages(seq)
            if fork is not None and len(fork) > len(shared) + len(stored):
                shared, stored = fork, []
            num_new = min(seq.num_tokens - (len(shared) + len(stored)) * bm.page_size, budget)
            if not bm.can_admit(seq, shared, len(stored) * bm.page_size + num_new):
                break
            if lora is not None:
                self.lora_slots.acquire(lora, lora_slot)
            bm.admit(seq, shared, stored, count_query=seq.num_output_tokens == 0)
            if seq.num_cached_tokens is None:  # at its first admission, as vLLM's usage reports it
                seq.num_cached_tokens = seq.num_computed_tokens
            bm.grow(seq, seq.num_computed_tokens + num_new)
            self._leave_waiting(i)
            bisect.insort(self.running, seq, key=_schedule_key)
            seq.slot, seq.lora_slot = self._free_slots.pop(), lora_slot
            seq.status = SequenceStatus.RUNNING
            out.admitted.append(seq)
            scheduled[seq] = ScheduledChunk(seq, seq.num_computed_tokens, num_new)
            budget -= num_new

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: dict[Sequence, ScheduledChunk],
                   out: SchedulerOutput) -> int:
        """Preempts the newest running sequences, `seq` itself last, until `seq` may hold `num_tokens` tokens or is
        preempted; returns the budget the preempted sequences' unscheduling gives back."""
        refund = 0
        while seq.status is SequenceStatus.RUNNING and not self.block_manager.can_grow(seq, num_tokens):
            refund += self._preempt(self.running[-1], scheduled, out)
        return refund

    def _fork_pages(self, seq: Sequence) -> list[int] | None:
        """The prompt's full pages held by the request's first sequence, if it still holds them."""
        parent = seq.parent
        if (parent is None or parent.status is not SequenceStatus.RUNNING or seq.num_output_tokens
                or seq.computes_every_token):
            return None
        num_pages = min((seq.num_tokens - 1) // self.block_manager.page_size,
                        parent.num_computed_tokens // self.block_manager.page_size)
        return parent.page_table[:num_pages]

    def _preempt(self, seq: Sequence, scheduled: dict[Sequence, ScheduledChunk], out: SchedulerOutput) -> int:
        """Sends `seq` back to waiting with no pages; returns the budget its unscheduling gives back."""
        chunk = scheduled.pop(seq, None)
        self._leave_running(seq)
        self.block_manager.free(seq)
        self.add(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        return 0 if chunk is None else chunk.num_tokens

    def _waiting_index(self, seq: Sequence) -> int:
        index = bisect.bisect_left(self.waiting, seq.schedule_key, key=_schedule_key)
        while self.waiting[index] is not seq:  # keys are unique in an engine (arrival, choice), not in every test
            index += 1
        return index

    def _leave_waiting(self, index: int) -> None:
        request_id = self.waiting.pop(index).request_id
        self._waiting_requests[request_id] -= 1
        if not self._waiting_requests[request_id]:
            del self._waiting_requests[request_id]

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_slots.append(seq.slot)
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
        seq.slot = seq.lora_slot = -1

    def reserve_lookahead(self, chunks: list[ScheduledChunk], limits: list[int]) -> bool:
        """Gives each decoding chunk's sequence pages for `limits[i]` tokens from its start (a multi-step call);
        False, reserving nothing more, if the pool cannot hold them all."""
        bm = self.block_manager
        ends = np.array([c.start for c in chunks]) + limits
        missing = bm.pages_needed(ends) - np.array([len(c.seq.page_table) for c in chunks])
        if missing[missing > 0].sum() > bm.num_free_pages:
            return False
        for i in np.flatnonzero(missing > 0).tolist():
            bm.grow(chunks[i].seq, int(ends[i]))
        return True
