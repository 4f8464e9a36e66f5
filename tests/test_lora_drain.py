"""A LoRA slot drained for a sequence whose adapter finds every slot in use (`LoraSlots.find`): no sequence after it
in the scheduler's waiting order joins the slot, so it is not starved by requests for the adapter in it; and the
drain lasts one scheduling pass (`LoraSlots.begin_pass`), so it holds back no sequence ahead of it (a more urgent
one, its request's other choices) and nothing once it has left the waiting set."""

from __future__ import annotations

from sequences import make_sequence
from sluice.batching.block_manager import BlockManager
from sluice.batching.lora_slots import LoraSlots
from sluice.batching.sampling_params import LoraRequest, SamplingParams
from sluice.batching.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from sluice.batching.sequence import Sequence

A, B = (LoraRequest(name, name * 64) for name in "ab")


def one_slot(max_num_batched_tokens: int = 64) -> Scheduler:
    """A scheduler over one LoRA slot, which holds A."""
    return Scheduler(SchedulerConfig(8, max_num_batched_tokens), BlockManager(64, 4), LoraSlots(1, [A]))


def step(sched: Scheduler) -> SchedulerOutput:
    """A scheduling pass, then its step as run: every scheduled chunk's tokens are computed."""
    out = sched.schedule()
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
    return out


def add(sched: Scheduler, seq_id: int, lora: LoraRequest, priority: int = 0) -> Sequence:
    seq = make_sequence(seq_id, [3 * seq_id + 1, 3 * seq_id + 2, 3 * seq_id + 3],
                        SamplingParams(lora=lora, max_tokens=100, priority=priority))
    sched.add(seq)
    return seq


def test_a_waiting_adapter_gets_the_slot_though_requests_for_the_adapter_in_it_keep_coming():
    sched = one_slot()
    running = add(sched, 0, A)
    step(sched)
    waiter = add(sched, 1, B)
    for seq_id in range(2, 6):
        add(sched, seq_id, A)
        assert step(sched).admitted == []
    sched.finish(running)
    assert step(sched).admitted == [waiter] and waiter.lora_slot == 0 and sched.lora_slots.writes == {0: B}


def test_a_waiter_that_leaves_holds_back_no_request_for_the_adapter_in_the_slot():
    sched = one_slot()
    add(sched, 0, A)
    step(sched)
    waiter = add(sched, 1, B)
    step(sched)  # the waiter drains A's slot
    sched.finish(waiter)  # aborted while it waits
    later = add(sched, 2, A)
    assert step(sched).admitted == [later] and sched.lora_slots.users == [2]


def test_a_more_urgent_request_for_the_adapter_in_the_slot_runs_ahead_of_the_waiter():
    """Lower priority value first, as vLLM's: a drain is for the sequences behind the waiter, not ahead of it."""
    sched = one_slot()
    add(sched, 0, A)
    step(sched)
    waiter = add(sched, 1, B, priority=10)
    step(sched)
    urgent = add(sched, 2, A, priority=-10)
    add(sched, 3, A, priority=10)  # behind the waiter: it waits
    assert step(sched).admitted == [urgent] and sched.waiting[0] is waiter and sched.lora_slots.users == [2]


def test_the_choices_of_an_n_request_share_their_slot_and_pages_though_another_adapter_waits():
    """Its later choices wait for the first to prefill the prompt, then fork its pages: a drain for an adapter that
    came after the request would keep them waiting until the first choice had generated all its tokens."""
    sched = one_slot(max_num_batched_tokens=16)
    params = SamplingParams(lora=A, max_tokens=100, n=2)
    prompt = list(range(1, 41))  # prefilled in three passes of 16 tokens
    first = make_sequence(0, prompt, params)
    second = make_sequence(0, prompt, params, choice=1, parent=first)
    sched.add(first)
    sched.add(second)
    step(sched)
    add(sched, 1, B)
    step(sched)
    step(sched)
    assert first.num_computed_tokens == len(prompt)
    assert step(sched).admitted == [second] and sched.lora_slots.users == [2]
    assert second.page_table[:9] == first.page_table[:9]  # the prompt's full pages but its last token's
