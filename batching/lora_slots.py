"""The model's LoRA slots on the device, and which served adapter each holds (vLLM's `--max-loras`).

Every served adapter's weights are kept in host memory (`LoraRequest.weights`), or with vLLM's `--max-cpu-loras` only
the most recently used ones' (`hold`); a batch runs with at most as many adapters as there are slots. The scheduler
looks up a slot for a sequence with an adapter (`find`), takes it once it admits the sequence (`acquire`) and gives
it back when the sequence leaves the running set (`release`): its adapter's slot if one holds it, else the least
recently used slot no running sequence uses, whose weights the engine then writes before the step that needs them
(`writes`). A sequence whose adapter finds every slot in use drains one for the rest of the scheduling pass (`find`):
no sequence after it in the waiting order joins it, so the adapter gets it once its running sequences are done,
however many requests for the adapter in it keep coming. Each pass decides it afresh (`begin_pass`).
Weights host memory dropped are read again from the adapter's folder on a reader thread (`find` starts
the read, the engine takes it in between steps: `take_in`): the sequences that need them wait, the others run on.
An adapter is its name and its files' fingerprint: one loaded in place is another adapter, so a slot holding the old
weights serves no new sequence. Owned by the engine thread, bar the reads' own work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from sluice.batching.sampling_params import LoraRequest


class LoraSlots:
    """`holders[s]`: the adapter slot s holds (None: none to run with, its rows zeros or what a failed write left);
    `users[s]`: the running sequences that use it; `writes`: slot -> the adapter whose weights must be written there
    before the next step is dispatched; `reads`: adapter -> its weights being read again (`find`)."""

    def __init__(self, num_slots: int, resident: Sequence[LoraRequest], max_held: int | None = None,
                 read_again: Callable[[LoraRequest], dict[str, np.ndarray]] | None = None):
        """`resident`: the adapters already in the first slots, in order. `max_held` (--max-cpu-loras): the most
        adapters whose weights host memory holds (`hold`); None: every adapter's. `read_again`: an adapter's weights
        read again from its folder, or its error (`LoraRegistry._read_again`), run on the reader thread."""
        self.holders: list[LoraRequest | None] = [*resident, *[None] * (num_slots - len(resident))]
        self.users = [0] * num_slots
        self.writes: dict[int, LoraRequest] = {}
        self._slot_of = {lora: slot for slot, lora in enumerate(resident)}
        # The slots no running sequence uses, least recently used first: the empty ones before any that holds one.
        self._unused = dict.fromkeys([*range(len(resident), num_slots), *range(len(resident))])
        self._draining: int | None = None  # the slot no sequence joins for the rest of this pass (`find`)
        self.max_held = max_held
        # The adapters whose weights host memory holds, least recently used first, by identity: one loaded again with
        # the same files is an equal adapter, but another object, with weights of its own.
        self.held: dict[int, LoraRequest] = {}
        self.reads: dict[LoraRequest, Future[dict[str, np.ndarray]]] = {}
        self._read_again = read_again
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-reader")

    @property
    def num_slots(self) -> int:
        return len(self.holders)

    def begin_pass(self) -> None:
        """A scheduling pass starts: no slot is drained until a sequence looked at in it finds none (`find`). A drain
        kept from an earlier pass would hold back sequences ahead of the one it was for (more urgent ones, or its
        request's other choices), and outlive that one when it leaves the waiting set."""
        self._draining = None

    def find(self, lora: LoraRequest) -> int | None:
        """The slot one more running sequence with `lora` would take, changing no slot: the one holding it, or the
        least recently used unused one; None while every slot holds another adapter in use, or while the weights
        host memory dropped are read again (started here, one read per adapter). Each read keeps an unused slot for
        its adapter: a sequence behind, whose adapter's weights are held, does not take it first (it could do so at
        every read, and the adapter read wait on). Finding every slot in use, it drains the one fewest running
        sequences use, until the pass ends: its adapter's sequences looked at after it wait too, and the first sequence
        looked at once it is unused takes it (the scheduler looks in its waiting order)."""
        slot = self._slot_of.get(lora)
        if slot is not None:
            return None if slot == self._draining else slot
        if not self._unused:
            self._drain()
            return None
        if lora in self.reads or len(self._unused) <= len(self.reads):
            return None
        slot = next(iter(self._unused))
        if lora.weights or self.max_held is None:
            return slot
        self.reads[lora] = self._reader.submit(self._read_again, lora)
        return None

    def _drain(self) -> None:
        if self._draining is None:
            self._draining = min(range(self.num_slots), key=self.users.__getitem__)

    def acquire(self, lora: LoraRequest, slot: int) -> None:
        """One more running sequence with `lora` takes `slot` (`find`'s), which is listed in `writes` to take its
        weights if it holds another adapter; `lora`'s weights, held, are the most recently used (`hold`)."""
        if self.holders[slot] != lora:
            self.empty(slot)
            self.holders[slot], self._slot_of[lora], self.writes[slot] = lora, slot, lora
        if not self.users[slot]:
            del self._unused[slot]
        self.users[slot] += 1
        if self.max_held is not None and id(lora) in self.held:  # used now, as vLLM's CPU cache is on each activation
            self.hold([lora])

    def empty(self, slot: int) -> None:
        """`slot` holds no adapter (one evicted, or its write failed) and has no write pending."""
        if (held := self.holders[slot]) is not None:
            del self._slot_of[held]
        self.holders[slot] = None
        self.writes.pop(slot, None)

    def release(self, slot: int) -> None:
        """A running sequence no longer uses `slot`; it is the most recently used once none does."""
        self.users[slot] -= 1
        if not self.users[slot]:
            self._unused[slot] = None

    def hold(self, loras: Iterable[LoraRequest]) -> None:
        """`loras`' weights were read, written or used just now: the most recently used of those held. Past `max_held`,
        the least recently used adapters' weights are dropped (emptied), to be read again from their folder when a
        slot needs them (`find`)."""
        if self.max_held is None:
            return
        for lora in loras:
            self.held.pop(id(lora), None)
            self.held[id(lora)] = lora
        while len(self.held) > self.max_held:
            self.held.pop(next(iter(self.held))).weights.clear()

    def take_in(self) -> list[tuple[LoraRequest, Exception]]:
        """Takes in the reads done (`find`): each adapter's weights, read, are the most recently used (`hold`).
        Between steps only: the weights held at a sequence's admission stay until its slot is written, as nothing
        else adds to those held then. Returns the adapters whose read failed, each with its error."""
        failed = []
        for lora, read in [(lora, read) for lora, read in self.reads.items() if read.done()]:
            del self.reads[lora]
            if (error := read.exception()) is not None:
                failed.append((lora, error))
            else:
                lora.weights.update(read.result())
                self.hold([lora])
        return failed

    def forget(self, lora: LoraRequest) -> None:
        """`lora` is no longer served (unloaded, or replaced in place): with `max_held`, its weights are dropped now
        and its place among the held is a served adapter's. A slot holding it keeps its rows on the device; a request
        still waiting with it reads its files again should it need a slot (`find`)."""
        if self.max_held is not None and self.held.pop(id(lora), None) is not None:
            lora.weights.clear()
