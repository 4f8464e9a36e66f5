"""vLLM's `--max-loras`: adapters swapped into a bounded set of device slots. Every served adapter stays in host
memory; the scheduler admits a sequence with an adapter only into a slot (`LoraSlots`: its own adapter's, or the
least recently used one no running sequence uses, whose weights are then written before the step), so a batch
never holds more adapters than slots, and every request gets the tokens it gets with every adapter resident
(tests/data/tiny_lora's HF + PEFT goldens, as tests/test_lora_serving.py checks them)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from golden_checks import assert_completion_gives_case, golden_engine, golden_params, home  # noqa: F401 (a fixture)
from test_lora_serving import ADAPTERS, BASE, LORA, MODULES, case_named, folder, fresh  # noqa: F401 (a fixture)
from sequences import make_sequence
from sluice.app.arguments import CommandError
from sluice.app.serve import ENGINE_TUNING_FLAGS, add_arguments, checked_engine_config
from sluice.batching.block_manager import BlockManager
from sluice.batching.config import EngineConfig, InvalidEngineConfig
from sluice.batching.engine import Engine
from sluice.batching.input_batch import InputBatch
from sluice.batching.lora_slots import LoraSlots
from sluice.batching.outputs import ListCollector
from sluice.batching.sampling_params import LoraRequest, RequestRejected, SamplingParams
from sluice.batching.scheduler import Scheduler, SchedulerConfig
from sluice.batching.sequence import Sequence

A, B, C = (LoraRequest(name, name * 64) for name in "abc")
FOLDERS = dict(MODULES)


def test_a_resident_adapter_takes_its_slot_again_without_a_write():
    slots = LoraSlots(2, [A])
    assert slots.acquire(A) == 0 and slots.acquire(A) == 0 and not slots.writes
    slots.release(0)
    slots.release(0)
    assert slots.acquire(A) == 0 and not slots.writes


def test_an_adapter_takes_the_least_recently_used_slot_no_running_sequence_uses_and_is_written_there():
    slots = LoraSlots(2, [A, B])
    slots.release(slots.acquire(B))
    slots.release(slots.acquire(A))  # B's slot is now the least recently used
    assert slots.acquire(C) == 1 and slots.writes == {1: C}
    assert slots.holders == [A, C]


def test_an_empty_slot_is_taken_before_one_that_holds_an_adapter():
    slots = LoraSlots(2, [A])
    assert slots.acquire(B) == 1 and slots.holders == [A, B]


def test_no_slot_while_every_slot_holds_another_adapter_a_running_sequence_uses():
    slots = LoraSlots(1, [A])
    slot = slots.acquire(A)
    assert slots.acquire(B) is None and slots.holders == [A] and not slots.writes
    slots.release(slot)
    assert slots.acquire(B) == 0 and slots.writes == {0: B}


def test_an_adapter_loaded_in_place_is_another_adapter_than_the_one_its_slot_holds():
    """Same name, other files: the slot's weights are the old ones, which no new sequence may run with."""
    slots = LoraSlots(1, [A])
    assert slots.acquire(LoraRequest("a", "d" * 64)) == 0 and 0 in slots.writes


def test_the_scheduler_skips_a_sequence_whose_adapter_finds_no_slot_and_admits_the_others():
    slots = LoraSlots(1, [A])
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, 4), slots)
    loras = [A, B, None, A]
    seqs = [make_sequence(i, range(10 * i, 10 * i + 3), SamplingParams(lora=lora)) for i, lora in enumerate(loras)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert out.admitted == [seqs[0], seqs[2], seqs[3]] and sched.waiting == [seqs[1]]
    assert [seq.lora_slot for seq in seqs] == [0, -1, -1, 0] and slots.users == [2]
    sched.finish(seqs[0])
    assert sched.schedule().admitted == [] and slots.users == [1]
    sched.finish(seqs[3])
    assert sched.schedule().admitted == [seqs[1]] and seqs[1].lora_slot == 0 and slots.writes == {0: B}


def record_steps(engine: Engine, monkeypatch) -> list[dict[Sequence, int]]:
    """Each step the engine dispatches, as the LoRA slot of each of its sequences with an adapter, checked against
    the slot table then: a sequence runs in the slot that holds its adapter, its weights written."""
    steps = []
    dispatch = engine.runner.dispatch

    def recording(chunks, *args, **kwargs):
        assert not engine.lora_slots.writes
        for chunk in chunks:
            seq = chunk.seq
            assert seq.lora_slot == -1 if seq.params.lora is None else (
                engine.lora_slots.holders[seq.lora_slot] == seq.params.lora)
        steps.append({chunk.seq: chunk.seq.lora_slot for chunk in chunks if chunk.seq.params.lora is not None})
        return dispatch(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    return steps


def adapters(step: dict[Sequence, int]) -> set[str]:
    return {seq.params.lora.name for seq in step}


def run_all(engine: Engine, names: list[str | None], case_name: str, **fields) -> None:
    """Runs `case_name` of each of `names` (None: the base) in one engine run; each gives its golden."""
    cases = [case_named((BASE if name is None else ADAPTERS[name])["cases"], case_name)
             for name in names]
    outputs = engine.generate([case["prompt_ids"] for case in cases],
                              [golden_params(BASE, lora=engine.adapters.get(name), **fields) for name in names])
    for name, case, [output] in zip(names, cases, outputs, strict=True):
        assert_completion_gives_case(output, case | {"name": f"{name or 'base'}: {case['name']}"})


@pytest.fixture(scope="module")
def one_slot(folder) -> Engine:
    """An engine of one LoRA slot serving both tiny adapters."""
    return golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, max_loras=1)


def test_one_slot_serves_two_adapters_and_the_base_in_one_run_a_batch_holding_one_adapter(one_slot, monkeypatch):
    steps = record_steps(one_slot, monkeypatch)
    run_all(one_slot, [None, "all_modules", "qv_rslora", None, "qv_rslora", "all_modules"], "short")
    assert one_slot.stats.max_loras == 1 and len(one_slot.lora_slots.holders) == 1
    assert all(len(adapters(step)) <= 1 for step in steps)
    assert set().union(*map(adapters, steps)) == {"all_modules", "qv_rslora"}
    assert one_slot.lora_slots.users == [0]


def test_preempted_sequences_swap_adapters_in_a_small_pool_and_keep_their_tokens(one_slot, monkeypatch):
    """Four sequences of 112 tokens need more than the pool's 64 pages of 4: some are preempted, and wait again
    for their adapter's slot."""
    names = ["all_modules", None, "all_modules", None, "qv_rslora", "qv_rslora"]
    prompts = [[(7 * i + j) % 300 + 3 for j in range(100)] for i in range(len(names))]
    params = [golden_params(BASE, lora=one_slot.adapters.get(name), cache_salt="alone") for name in names]
    alone = [one_slot.generate([prompt], p)[0][0].token_ids for prompt, p in zip(prompts, params)]
    steps = record_steps(one_slot, monkeypatch)
    preemptions = one_slot.scheduler.num_preemptions
    together = one_slot.generate(prompts, [replace(p, cache_salt="together") for p in params])
    assert [output.token_ids for [output] in together] == alone
    assert one_slot.scheduler.num_preemptions > preemptions
    assert all(len(adapters(step)) <= 1 for step in steps)
    assert one_slot.block_manager.num_free_pages == one_slot.block_manager.num_pages
    assert one_slot.lora_slots.users == [0]


def test_a_sequence_admitted_again_runs_in_the_lora_slot_it_got_then():
    """Preempted and admitted again, maybe into the same row of the input batch but another LoRA slot."""
    batch = InputBatch(2, 4, 300, 1, [2])
    seq = make_sequence(1, [1, 2, 3], SamplingParams(lora=A))
    seq.slot, seq.lora_slot, seq.page_table = 0, 1, [5]
    batch.writes([seq])
    seq.lora_slot, seq.page_table = 0, [6]  # as `BlockManager.admit` gives it: a new page list
    batch.writes([seq])
    assert batch.host.adapter[0] == 0


def test_more_adapters_loaded_at_runtime_than_slots_each_give_their_goldens(folder):
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_loras=1,
                           max_lora_rank=8)
    for name, path in MODULES:
        engine.load_lora(name, path)
    engine.step()
    assert set(engine.adapters) == set(FOLDERS)
    run_all(engine, ["qv_rslora", None, "all_modules", "qv_rslora"], "short")


def test_an_adapter_unloaded_while_its_requests_run_and_wait_serves_them_and_refuses_new_ones(folder):
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, max_loras=1,
                           allow_runtime_lora_updating=True, max_lora_rank=8)
    cases = {name: case_named(ADAPTERS[name]["cases"], "short") for name in FOLDERS}
    order = ["all_modules", "qv_rslora", "all_modules"]  # the second waits for the slot the others hold
    sinks = [ListCollector(1) for _ in order]
    for i, (name, sink) in enumerate(zip(order, sinks)):
        engine.submit([cases[name]["prompt_ids"]], golden_params(LORA, lora=engine.adapters[name]), sink, f"r{i}")
    engine.step()
    assert engine.stats.lora_running == ("all_modules",) and engine.stats.lora_waiting == ("qv_rslora",)
    for name in FOLDERS:
        engine.unload_lora(name)
    engine.step()
    assert not engine.adapters
    with pytest.raises(RequestRejected, match="not served here"):
        engine.submit([[1, 2, 3]], golden_params(LORA, lora=LoraRequest("qv_rslora", "0" * 64)), ListCollector(1),
                      "late")
    while engine.has_work:
        engine.step()
    for name, sink in zip(order, sinks):
        [output] = sink.completions()
        assert_completion_gives_case(output, cases[name])
    assert engine.lora_slots.users == [0]


def test_swapping_adapters_is_refused_over_several_processes(folder, monkeypatch):
    """The other processes replay steps: a slot written on process 0 alone would leave theirs as they were."""
    monkeypatch.setattr("sluice.batching.step_broadcast.is_multiprocess", lambda: True)
    with pytest.raises(InvalidEngineConfig, match="max_loras"):
        golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, max_loras=1)


def engine_config(flags: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return checked_engine_config(parser.parse_args(flags), ENGINE_TUNING_FLAGS)


def test_max_cpu_loras_below_max_loras_is_refused_as_vllm_refuses_it():
    with pytest.raises(CommandError, match=r"--max-cpu-loras \(1\) must be >= --max-loras \(2\)"):
        engine_config(["--max-loras", "2", "--max-cpu-loras", "1"])


@pytest.mark.parametrize("flags", [["--max-loras", "2", "--max-cpu-loras", "2"], ["--max-cpu-loras", "1"]])
def test_max_cpu_loras_at_least_max_loras_or_alone_is_taken(flags):
    assert engine_config(flags).enable_lora == ("--max-loras" in flags)
