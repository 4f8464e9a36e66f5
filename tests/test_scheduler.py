"""Scheduler: token budget, max_num_seqs, decodes before chunked prefill, priority, preemption of the newest."""

import pytest

from sluice.batching.block_manager import BlockManager
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from sluice.batching.sequence import Sequence, SequenceStatus

from sequences import make_sequence

PAGE = 4


def make_scheduler(num_pages: int = 64, max_num_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget), BlockManager(num_pages, PAGE))


def add(sched: Scheduler, seq_id: int, prompt_len: int, priority: int = 0) -> Sequence:
    seq = make_sequence(seq_id, range(100 * seq_id, 100 * seq_id + prompt_len), SamplingParams(priority=priority))
    sched.add(seq)
    return seq


def run_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Completes the scheduled step as the engine does: its tokens are computed and their full pages cached, and
    sampling rows get one new token."""
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
        sched.block_manager.commit(chunk.seq)
        if chunk.sample:
            chunk.seq.token_ids.append(token)


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    sched = make_scheduler(budget=16)
    seq = add(sched, 1, prompt_len=40)
    sizes = []
    for _ in range(3):
        out = sched.schedule()
        sizes.append([(c.start, c.num_tokens, c.sample) for c in out.chunks])
        run_step(sched, out)
    assert sizes == [[(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    assert seq.num_output_tokens == 1


def test_running_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(budget=8)
    a = add(sched, 1, prompt_len=4)
    run_step(sched, sched.schedule())
    b = add(sched, 2, prompt_len=20)
    out = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 1), (b, 7)]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2, budget=64)
    seqs = [add(sched, i, prompt_len=3) for i in range(4)]
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == seqs[:2]
    assert sched.waiting == seqs[2:]


def test_lower_priority_value_is_admitted_first_then_arrival_order():
    sched = make_scheduler(max_num_seqs=2, budget=64)
    late = add(sched, 1, prompt_len=3, priority=1)
    urgent = add(sched, 2, prompt_len=3, priority=-1)
    normal = add(sched, 3, prompt_len=3)
    assert [c.seq for c in sched.schedule().chunks] == [urgent, normal]
    assert sched.waiting == [late]


def test_out_of_pages_preempts_the_newest_running_sequence_and_frees_its_pages():
    sched = make_scheduler(num_pages=4, budget=64)
    old = add(sched, 1, prompt_len=PAGE * 2)  # 2 pages, its next token needs a third
    new = add(sched, 2, prompt_len=PAGE * 2 - 1)  # 2 pages
    run_step(sched, sched.schedule())
    assert sched.block_manager.num_free_pages == 0
    out = sched.schedule()
    assert out.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.page_table == [] and new.num_computed_tokens == 0
    assert [c.seq for c in out.chunks] == [old]
    assert sched.num_preemptions == 1


def test_preempted_sequence_recomputes_all_its_tokens_when_readmitted():
    sched = make_scheduler(num_pages=4, budget=64)
    old = add(sched, 1, prompt_len=PAGE * 2)
    new = add(sched, 2, prompt_len=PAGE * 2 - 1)
    run_step(sched, sched.schedule())
    run_step(sched, sched.schedule())  # `new` preempted, `old` decodes
    sched.finish(old)
    out = sched.schedule()
    # 7 prompt tokens + 1 sampled: the first full page comes back from the prefix cache, the rest is recomputed
    assert [(c.seq, c.start, c.num_tokens, c.sample) for c in out.chunks] == [(new, PAGE, 4, True)]


def test_cached_tokens_are_those_found_at_the_first_admission_not_after_a_preemption():
    sched = make_scheduler(num_pages=4, budget=12)
    old = add(sched, 1, prompt_len=PAGE * 2)
    new = add(sched, 2, prompt_len=PAGE * 2 + 2)
    run_step(sched, sched.schedule())  # `old` prefills, `new` its first page
    out = sched.schedule()  # `old` takes the last free page: `new`, mid-prefill, is preempted
    assert out.preempted == [new] and new.num_cached_tokens == 0
    run_step(sched, out)
    sched.finish(old)
    out = sched.schedule()
    assert out.chunks[0].start == PAGE  # its own first page came back from the prefix cache...
    assert new.num_cached_tokens == 0  # ... but its usage reports what the cache held when it first arrived (vLLM's)


def test_finish_frees_pages_of_waiting_and_running_sequences():
    sched = make_scheduler(budget=8)
    running = add(sched, 1, prompt_len=20)
    waiting = add(sched, 2, prompt_len=20)
    sched.schedule()
    sched.finish(running)
    sched.finish(waiting)
    assert sched.block_manager.num_used_pages == 0
    assert not sched.has_work


def test_the_queue_stays_in_schedule_order_as_sequences_come_and_go():
    """The queue is kept ordered as sequences enter (arrival, preemption) and leave (admission, finish), not
    sorted at each step; the requests waiting are those with a sequence waiting and none running."""
    sched = make_scheduler(num_pages=4, max_num_seqs=2, budget=64)
    old = add(sched, 1, prompt_len=PAGE * 2)  # 2 pages, its next token needs a third
    new = add(sched, 2, prompt_len=PAGE * 2 - 1)
    late, normal = add(sched, 3, 3, priority=1), add(sched, 4, 3)
    sibling = make_sequence(5, normal.prompt_ids, normal.params, choice=1, parent=normal, arrival=4)
    sched.add(sibling)
    assert sched.waiting == [old, new, normal, sibling, late] and sched.num_requests() == (0, 4)
    run_step(sched, sched.schedule())
    assert sched.waiting == [normal, sibling, late] and sched.num_requests() == (2, 2)
    assert sched.schedule().preempted == [new]
    urgent = add(sched, 6, 3, priority=-1)
    assert sched.waiting == [urgent, new, normal, sibling, late]
    sched.finish(sibling)
    assert sched.waiting == [urgent, new, normal, late] and sched.num_requests() == (1, 4)
    sched.finish(old)
    assert [c.seq for c in sched.schedule().chunks] == [urgent, new] and sched.waiting == [normal, late]

    sched = make_scheduler(budget=64)
    first = add(sched, 1, prompt_len=10)
    sched.add(make_sequence(2, first.prompt_ids, first.params, choice=1, parent=first, arrival=1))
    sched.schedule()  # the sibling waits for the prompt, its request runs
    assert len(sched.waiting) == 1 and sched.num_requests() == (1, 0)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_sibling_waits_for_the_prompt_then_shares_its_full_pages(prefix_caching):
    """Shared with prefix caching off too; the pages count as prefix-cache hits only where there is a cache."""
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, PAGE, enable_prefix_caching=prefix_caching))
    first = add(sched, 1, prompt_len=10)
    sibling = make_sequence(2, first.prompt_ids, first.params, choice=1, parent=first, arrival=1)
    sched.add(sibling)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [first]
    run_step(sched, out)
    out = sched.schedule()
    chunk = next(c for c in out.chunks if c.seq is sibling)
    assert sibling.page_table[:2] == first.page_table[:2]
    assert (chunk.start, chunk.num_tokens) == (2 * PAGE, 10 - 2 * PAGE)
    counters = sched.block_manager.counters()
    assert (counters.prefix_cache_hit_tokens, counters.prefix_cache_query_tokens) == ((2 * PAGE, 20) if prefix_caching
                                                                                      else (0, 0))


def test_drafts_take_only_the_budget_every_later_running_sequence_s_next_token_leaves():
    """A sequence copying text drafts at every step: were its drafts given the whole budget first, the running
    sequences after it would get no token for as long as it drafts."""
    sched = make_scheduler(max_num_seqs=2, budget=4)
    a, b = add(sched, 1, prompt_len=3), add(sched, 2, prompt_len=3)
    run_step(sched, sched.schedule())
    a.drafts = [5, 6, 7]
    out = sched.schedule()
    assert [(c.seq, c.num_tokens, c.num_drafts) for c in out.chunks] == [(a, 3, 2), (b, 1, 0)]
