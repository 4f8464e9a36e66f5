"""The model's LoRA slots on the device, and which served adapter each holds (vLLM's `--max-loras`).

Every served adapter is kept in host memory (`LoraRequest.weights`); a batch runs with at most as many adapters as
there are slots. The scheduler takes a slot for a sequence with an adapter when it admits it (`acquire`) and gives it
back when the sequence leaves the running set (`release`): its adapter's slot if one holds it, else the least
recently used slot no running sequence uses, whose weights the engine then writes before the step that needs them
(`writes`). An adapter is its name and its files' fingerprint: one loaded in place is another adapter, so a slot
holding the old weights serves no new sequence. Owned by the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.batching.sampling_params import LoraRequest


class LoraSlots:
    """`holders[s]`: the adapter slot s holds (None: zeros); `users[s]`: the running sequences that use it; `writes`:
    slot -> the adapter whose weights must be written there before the next step is dispatched."""

    def __init__(self, num_slots: int, resident: Sequence[LoraRequest]):
        """`resident`: the adapters already in the first slots, in order."""
        self.holders: list[LoraRequest | None] = [*resident, *[None] * (num_slots - len(resident))]
        self.users = [0] * num_slots
        self.writes: dict[int, LoraRequest] = {}
        self._slot_of = {lora: slot for slot, lora in enumerate(resident)}
        # The slots no running sequence uses, least recently used first: the empty ones before any that holds one.
        self._unused = dict.fromkeys([*range(len(resident), num_slots), *range(len(resident))])

    @property
    def num_slots(self) -> int:
        return len(self.holders)

    def acquire(self, lora: LoraRequest) -> int | None:
        """A slot for one more running sequence with `lora`: the one holding it, or the least recently used unused
        one, listed in `writes` to take its weights; None while every slot holds another adapter in use."""
        slot = self._slot_of.get(lora)
        if slot is None:
            if not self._unused:
                return None
            slot = next(iter(self._unused))
            if (evicted := self.holders[slot]) is not None:
                del self._slot_of[evicted]
            self.holders[slot], self._slot_of[lora], self.writes[slot] = lora, slot, lora
        if not self.users[slot]:
            del self._unused[slot]
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A running sequence no longer uses `slot`; it is the most recently used once none does."""
        self.users[slot] -= 1
        if not self.users[slot]:
            self._unused[slot] = None
