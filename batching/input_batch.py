"""The persistent input batch: each running sequence's page table, sampling parameters and LoRA adapter slot, kept
on the device.

The scheduler gives every running sequence a slot (`Sequence.slot`) from its admission until it is preempted or
finishes. Slot s's row holds that sequence's page table and its `SamplingBatch` row, in host arrays (numpy) and
on the device; one more row, the padding slot, stays empty, greedy and adapterless for a step's padding rows. Before
a step, only the rows that changed are sent, as whole rows in one scatter: a slot's new occupant, and sequences
that gained pages. A step then carries, per row, its slot and what changes every step (tokens, positions, the
sampler's output index); the device gathers page tables, sampling parameters and adapters by slot.

A page table only grows in place while its sequence runs, and is replaced by a new list on any other change
(`BlockManager`): a row is current while it was written from the same list and holds as many pages. A sequence's
LoRA slot (`Sequence.lora_slot`) is given at each admission, which gives it a new page list too: its row's adapter is
written with a whole page table.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from sluice.batching.sampler import SamplingBatch
from sluice.batching.sequence import Sequence


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotRows:
    """page_table: [N, max_pages] int32; sampling: each slot's `SamplingBatch` row (per-step fields unset);
    adapter: [N] int32, each slot's LoRA adapter slot (`model.lora`; -1: the base model)."""

    page_table: jax.Array
    sampling: SamplingBatch
    adapter: jax.Array


@dataclass(frozen=True)
class SlotWrites:
    """Rows to write: slots: [U] int32 (padded with the padding slot, whose row stays as it is), and their new
    contents, `SlotRows` of U rows (numpy)."""

    slots: np.ndarray
    rows: SlotRows


def write_rows(table: SlotRows, slots: jax.Array, rows: SlotRows) -> SlotRows:
    """The table with rows[i] at slots[i] (the padding slot's writes dropped: its row is the last)."""
    padding = table.page_table.shape[0] - 1
    target = jax.numpy.where(slots == padding, padding + 1, slots)
    return jax.tree.map(lambda old, new: old.at[target].set(new, mode="drop"), table, rows)


class InputBatch:
    """The host side of the slots: what each row holds, and which rows a step must send."""

    def __init__(self, num_slots: int, max_pages: int, vocab_size: int, num_stop_ids: int, buckets: list[int]):
        """`buckets`: how many rows one scatter writes (the fewest that hold a step's changed rows), ascending,
        the last at least `num_slots`."""
        self.padding_slot = num_slots
        self.vocab_size = vocab_size
        self.host = SlotRows(np.zeros((num_slots + 1, max_pages), np.int32),
                             SamplingBatch.empty(num_slots + 1, num_stop_ids), np.full(num_slots + 1, -1, np.int32))
        self._occupants: list[Sequence | None] = [None] * num_slots
        self._tables: list[list[int] | None] = [None] * num_slots  # the page list each row was written from
        self._num_pages = [0] * num_slots
        self.buckets = buckets

    def writes(self, seqs: list[Sequence]) -> SlotWrites | None:
        """Brings the host rows of `seqs` up to date; returns the rows the device must take (None: none)."""
        dirty = []
        for seq in seqs:
            slot, pages = seq.slot, seq.page_table
            changed = False
            if self._occupants[slot] is not seq:
                self._occupants[slot] = seq
                self.host.sampling.write(slot, seq.params, seq.seed, seq.stop.stop_id_list, seq.num_prompt_tokens,
                                         self.vocab_size)
                changed = True
            if self._tables[slot] is not pages or self._num_pages[slot] != len(pages):
                start = self._num_pages[slot] if self._tables[slot] is pages else 0
                if not start:  # as after each admission (a new page list), which may give another LoRA slot
                    self.host.adapter[slot] = seq.lora_slot
                self.host.page_table[slot, start:len(pages)] = pages[start:]
                self._tables[slot], self._num_pages[slot] = pages, len(pages)
                changed = True
            if changed:
                dirty.append(slot)
        if not dirty:
            return None
        return self.slot_writes(dirty, next(b for b in self.buckets if b >= len(dirty)))

    def slot_writes(self, dirty: list[int], size: int) -> SlotWrites:
        """The host rows of `dirty` slots as `size` writes, the rest writes that change nothing (with no dirty slots:
        to compile, or to mirror another process's shapes)."""
        slots = np.full(size, self.padding_slot, np.int32)
        slots[:len(dirty)] = dirty
        return SlotWrites(slots, jax.tree.map(lambda x: x[slots], self.host))
