"""vLLM's `--max-loras`: adapters swapped into a bounded set of device slots, and `--max-cpu-loras`: the adapters
whose weights host memory keeps, the others read again from their folder. The scheduler admits a sequence with an
adapter only into a slot (`LoraSlots`: its own adapter's, or the least recently used one no running sequence uses,
whose weights are then written before the step), so a batch never holds more adapters than slots, and every request
gets the tokens it gets with every adapter resident (tests/data/tiny_lora's HF + PEFT goldens, as
tests/test_lora_serving.py checks them)."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import uuid
from functools import partial
from pathlib import Path

import jax
import numpy as np
import pytest

from golden_checks import assert_completion_gives_case, golden_engine, golden_params, home  # noqa: F401 (a fixture)
from test_lora_serving import ADAPTERS, BASE, LORA, MODULES, case_named, folder, fresh  # noqa: F401 (a fixture)
from sequences import make_sequence
from sluice.app.arguments import CommandError
from sluice.app.serve import ENGINE_TUNING_FLAGS, add_arguments, checked_engine_config
from sluice.batching import lora_registry, scheduler
from sluice.batching.block_manager import BlockManager
from sluice.batching.config import EngineConfig, InvalidEngineConfig
from sluice.batching.engine import Engine
from sluice.batching.input_batch import InputBatch
from sluice.batching.lora_slots import LoraSlots
from sluice.batching.outputs import Completion, ListCollector
from sluice.batching.sampling_params import LoraRequest, RequestRejected, SamplingParams
from sluice.batching.scheduler import Scheduler, SchedulerConfig
from sluice.batching.sequence import Sequence
from sluice.model.llama import LORA_PARAMS
from sluice.model.lora import CONFIG_FILE, WEIGHTS_FILE, LoraError

A, B, C = (LoraRequest(name, name * 64) for name in "abc")
FOLDERS = dict(MODULES)
MAX_STEPS = 500  # far more than any test here takes: a scheduling hang fails instead of hanging


def take(slots: LoraSlots, lora: LoraRequest) -> int | None:
    """The slot a sequence with `lora` is admitted into (`find`, then `acquire`), or None."""
    slot = slots.find(lora)
    if slot is not None:
        slots.acquire(lora, slot)
    return slot


def test_a_resident_adapter_takes_its_slot_again_without_a_write():
    slots = LoraSlots(2, [A])
    assert take(slots, A) == 0 and take(slots, A) == 0 and not slots.writes
    slots.release(0)
    slots.release(0)
    assert take(slots, A) == 0 and not slots.writes


def test_an_adapter_takes_the_least_recently_used_slot_no_running_sequence_uses_and_is_written_there():
    slots = LoraSlots(2, [A, B])
    slots.release(take(slots, B))
    slots.release(take(slots, A))  # B's slot is now the least recently used
    assert take(slots, C) == 1 and slots.writes == {1: C}
    assert slots.holders == [A, C]


def test_a_later_sequence_of_an_adapter_in_use_waits_behind_one_whose_adapter_finds_no_slot():
    """Else a steady stream of requests for the adapters in the slots keeps every slot in use, and the waiting
    adapter never gets one."""
    slots = LoraSlots(1, [A])
    slot = take(slots, A)
    assert take(slots, B) is None
    assert take(slots, A) is None and slots.users == [1]
    slots.release(slot)
    assert take(slots, B) == 0 and slots.writes == {0: B}


def test_the_slot_drained_for_a_waiting_adapter_is_the_one_fewest_running_sequences_use():
    slots = LoraSlots(2, [A, B])
    take(slots, A), take(slots, A), take(slots, B)
    assert take(slots, C) is None
    assert take(slots, A) == 0 and take(slots, B) is None


def test_an_empty_slot_is_taken_before_one_that_holds_an_adapter():
    slots = LoraSlots(2, [A])
    assert take(slots, B) == 1 and slots.holders == [A, B]


def test_no_slot_while_every_slot_holds_another_adapter_a_running_sequence_uses():
    slots = LoraSlots(1, [A])
    slot = take(slots, A)
    assert take(slots, B) is None and slots.holders == [A] and not slots.writes
    slots.release(slot)
    assert take(slots, B) == 0 and slots.writes == {0: B}


def test_finding_a_slot_evicts_nothing_until_the_sequence_takes_it():
    slots = LoraSlots(1, [A])
    assert slots.find(B) == 0 and slots.holders == [A] and not slots.writes and slots.users == [0]


def test_an_adapter_loaded_in_place_is_another_adapter_than_the_one_its_slot_holds():
    """Same name, other files: the slot's weights are the old ones, which no new sequence may run with."""
    slots = LoraSlots(1, [A])
    assert take(slots, LoraRequest("a", "d" * 64)) == 0 and 0 in slots.writes


def test_a_sequence_the_pool_cannot_admit_evicts_no_adapter():
    """Its slot is looked up, not taken: the adapters resident stay, and no write is left pending for nobody."""
    slots = LoraSlots(2, [A, B])
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(4, 4), slots)
    sched.add(make_sequence(0, range(3, 43), SamplingParams(lora=C)))  # 10 pages of 4; the pool has 4
    assert sched.schedule().admitted == []
    assert slots.holders == [A, B] and not slots.writes and slots.users == [0, 0]


def test_the_scheduler_skips_a_sequence_whose_adapter_finds_no_slot_and_admits_the_others():
    slots = LoraSlots(1, [A])
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, 4), slots)
    loras = [A, A, B, None]
    seqs = [make_sequence(i, range(10 * i, 10 * i + 3), SamplingParams(lora=lora)) for i, lora in enumerate(loras)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert out.admitted == [seqs[0], seqs[1], seqs[3]] and sched.waiting == [seqs[2]]
    assert [seq.lora_slot for seq in seqs] == [0, 0, -1, -1] and slots.users == [2]
    sched.finish(seqs[0])
    assert sched.schedule().admitted == [] and slots.users == [1]
    sched.finish(seqs[1])
    assert sched.schedule().admitted == [seqs[2]] and seqs[2].lora_slot == 0 and slots.writes == {0: B}


def read_when(gate: threading.Event, readers: list[threading.Thread], timeout: float = 30.0):
    """A read of an adapter's weights (`LoraSlots`' `read_again`, or `lora_registry.read_adapter` as `wraps`) that
    notes the thread it runs on and waits for `gate` first (at most `timeout` s: a read on the engine thread then
    shows as one that came late, not as a hang)."""

    def read(*args, wraps=None, **kwargs):
        readers.append(threading.current_thread())
        gate.wait(timeout)
        return {"w": np.ones(2)} if wraps is None else wraps(*args, **kwargs)

    return read


def test_the_scheduler_skips_a_sequence_whose_adapter_is_read_again_and_admits_the_others():
    """b's weights were dropped and its slot must be written: its two sequences wait for one read of its files, on
    another thread, while the others are admitted; once the read is taken in (`take_in`) they are admitted."""
    gate, readers = threading.Event(), []
    a, b = (LoraRequest(name, name * 64, weights={"w": np.ones(2)}) for name in "ab")
    slots = LoraSlots(2, [a], max_held=1, read_again=read_when(gate, readers))
    slots.hold([b, a])
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, 4), slots)
    seqs = [make_sequence(i, range(10 * i, 10 * i + 3), SamplingParams(lora=lora))
            for i, lora in enumerate([b, None, b, a])]
    for seq in seqs:
        sched.add(seq)
    assert sched.schedule().admitted == [seqs[1], seqs[3]] and sched.waiting == [seqs[0], seqs[2]]
    assert not b.weights and not slots.writes and slots.take_in() == []
    gate.set()
    slots.reads[b].result(timeout=5)
    assert slots.take_in() == [] and b.weights and list(slots.held.values()) == [b]
    assert sched.schedule().admitted == [seqs[0], seqs[2]] and slots.writes == {1: b}
    assert len(readers) == 1 and readers[0] is not threading.current_thread()


def test_an_unused_slot_waits_for_the_adapter_read_for_it_not_for_one_behind_whose_weights_are_held():
    """One unused slot: b's weights are being read for it, and d's, held, come behind; d takes no slot before b."""
    gate, readers = threading.Event(), []
    a, b, d = (LoraRequest(name, name * 64, weights={"w": np.ones(2)}) for name in "abd")
    slots = LoraSlots(1, [a], max_held=2, read_again=read_when(gate, readers))
    slots.hold([b, d, a])
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, 4), slots)
    seqs = [make_sequence(i, range(10 * i, 10 * i + 3), SamplingParams(lora=lora)) for i, lora in enumerate([b, d])]
    for seq in seqs:
        sched.add(seq)
    assert not b.weights and d.weights and sched.schedule().admitted == [] and list(slots.reads) == [b]
    gate.set()
    slots.reads[b].result(timeout=5)
    assert slots.take_in() == [] and sched.schedule().admitted == [seqs[0]] and slots.writes == {0: b}
    assert sched.waiting == [seqs[1]]


def test_a_failed_read_is_taken_in_as_its_adapter_and_error():
    a, b = (LoraRequest(name, name * 64) for name in "ab")

    def read_again(lora: LoraRequest) -> dict[str, np.ndarray]:
        raise LoraError(f"LoRA adapter {lora.name!r}: gone")

    slots = LoraSlots(2, [a], max_held=1, read_again=read_again)
    assert slots.find(b) is None
    slots.reads[b].exception(timeout=5)
    [(lora, error)] = slots.take_in()
    assert lora is b and "gone" in str(error) and not slots.reads and not b.weights


def test_with_nothing_to_run_the_scheduler_waits_on_the_adapter_read_rather_than_spin(monkeypatch):
    gate, readers, waits = threading.Event(), [], []
    b = LoraRequest("b", "b" * 64)
    slots = LoraSlots(1, [A], max_held=1, read_again=read_when(gate, readers))
    sched = Scheduler(SchedulerConfig(8, 64), BlockManager(64, 4), slots)
    monkeypatch.setattr(scheduler, "wait", lambda futures, **kwargs: waits.append((list(futures), kwargs)))
    sched.add(make_sequence(0, range(3, 6), SamplingParams(lora=b)))
    assert sched.schedule().chunks == []
    gate.set()
    assert waits == [([slots.reads[b]], dict(timeout=scheduler.STORE_READ_WAIT_S, return_when="FIRST_COMPLETED"))]


def device_slot(engine: Engine, slot: int) -> dict[str, np.ndarray]:
    """What the device holds in LoRA slot `slot`: each LoRA parameter's part of it `[L, ...]`, as
    `LoraRequest.weights` holds an adapter's."""
    parts: dict[str, list[np.ndarray]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.runner.state)[0]:
        if (name := path[0].key) in LORA_PARAMS:  # a stack `[L, S, ...]`, or one layer's `[S, ...]` in layer order
            stacked = not isinstance(path[-1], jax.tree_util.SequenceKey)
            parts.setdefault(name, []).extend(np.asarray(leaf[:, slot] if stacked else leaf[slot:slot + 1]))
    return {name: np.stack(layers) for name, layers in parts.items()}


def record_steps(engine: Engine, monkeypatch) -> list[dict[Sequence, int]]:
    """Each step the engine dispatches, as the LoRA slot of each of its sequences with an adapter, checked against
    the device then: the slot a sequence runs in holds its adapter's weights (`LoraRequest.weights`)."""
    steps = []
    dispatch = engine.runner.dispatch

    def recording(chunks, *args, **kwargs):
        assert not engine.loras.slots.writes
        assert all(chunk.seq.lora_slot == -1 for chunk in chunks if chunk.seq.params.lora is None)
        for slot, lora in {c.seq.lora_slot: c.seq.params.lora for c in chunks if c.seq.params.lora}.items():
            on_device = device_slot(engine, slot)
            assert on_device.keys() == lora.weights.keys()
            for name, weight in lora.weights.items():
                np.testing.assert_array_equal(on_device[name], weight, err_msg=f"{lora.name}: {name}")
        steps.append({chunk.seq: chunk.seq.lora_slot for chunk in chunks if chunk.seq.params.lora is not None})
        return dispatch(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    return steps


def adapters(step: dict[Sequence, int]) -> set[str]:
    return {seq.params.lora.name for seq in step}


def drain(engine: Engine) -> None:
    """Steps until the engine has no work, failing after MAX_STEPS (a scheduling hang)."""
    for _ in range(MAX_STEPS):
        if not engine.has_work:
            return
        engine.step()
    pytest.fail(f"work left after {MAX_STEPS} steps: {engine.loras.slots.users=} {engine.loras.slots.holders=}")


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
    """`Engine.generate`, bounded by MAX_STEPS."""
    sinks = [ListCollector(p.n) for p in params]
    for i, (prompt, p, sink) in enumerate(zip(prompts, params, sinks, strict=True)):
        engine.submit([prompt], p, sink, f"generate-{uuid.uuid4().hex}-{i}")
    drain(engine)
    return [sink.completions() for sink in sinks]


def run_all(engine: Engine, names: list[str | None], case_name: str, **fields) -> None:
    """Runs `case_name` of each of `names` (None: the base) in one engine run; each of its choices gives its
    golden."""
    cases = [case_named((BASE if name is None else ADAPTERS[name])["cases"], case_name)
             for name in names]
    outputs = generate(engine, [case["prompt_ids"] for case in cases],
                       [golden_params(BASE, lora=engine.adapters.get(name), **fields) for name in names])
    for name, case, choices in zip(names, cases, outputs, strict=True):
        for output in choices:
            assert_completion_gives_case(output, case | {"name": f"{name or 'base'}: {case['name']}"})


@pytest.fixture(scope="module")
def one_slot(folder) -> Engine:
    """An engine of one LoRA slot serving both tiny adapters."""
    return golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, max_loras=1)


@pytest.fixture(scope="module")
def resident(folder) -> Engine:
    """An engine of a slot for each tiny adapter: it never swaps one."""
    return golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES)


def test_one_slot_serves_two_adapters_and_the_base_in_one_run_a_batch_holding_one_adapter(one_slot, monkeypatch):
    steps = record_steps(one_slot, monkeypatch)
    run_all(one_slot, [None, "all_modules", "qv_rslora", None, "qv_rslora", "all_modules"], "short")
    assert one_slot.stats.max_loras == 1 and len(one_slot.loras.slots.holders) == 1
    assert all(len(adapters(step)) <= 1 for step in steps)
    assert set().union(*map(adapters, steps)) == {"all_modules", "qv_rslora"}
    assert one_slot.loras.slots.users == [0]


def test_preempted_sequences_swap_adapters_in_a_small_pool_and_keep_their_tokens(one_slot, resident, monkeypatch):
    """Four sequences of 112 tokens need more than the pool's 64 pages of 4: some are preempted, and wait again
    for their adapter's slot. Each gets the tokens of an engine that holds every adapter in a slot of its own."""
    names = ["all_modules", None, "all_modules", None, "qv_rslora", "qv_rslora"]
    prompts = [[(7 * i + j) % 300 + 3 for j in range(100)] for i in range(len(names))]
    alone = [generate(resident, [prompt], [golden_params(BASE, lora=resident.adapters.get(name))])[0][0].token_ids
             for prompt, name in zip(prompts, names)]
    steps = record_steps(one_slot, monkeypatch)
    preemptions = one_slot.scheduler.num_preemptions
    together = generate(one_slot, prompts, [golden_params(BASE, lora=one_slot.adapters.get(name)) for name in names])
    assert [output.token_ids for [output] in together] == alone
    assert one_slot.scheduler.num_preemptions > preemptions
    assert all(len(adapters(step)) <= 1 for step in steps)
    assert one_slot.block_manager.num_free_pages == one_slot.block_manager.num_pages
    assert one_slot.loras.slots.users == [0]


def test_swapping_an_adapter_in_compiles_nothing_after_warm_up(folder):
    """The slots' weights are placed as the other weights are (committed to their devices), and written by one
    program warm-up compiles: a swap misses no compiled step."""
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, max_loras=1)
    engine.runner.warmup(progress=False)
    run_all(engine, ["all_modules"], "short")
    compiled = engine.runner.num_compiled()
    run_all(engine, ["qv_rslora"], "short")
    run_all(engine, ["all_modules"], "short")
    assert engine.runner.num_compiled() == compiled


def test_a_failed_slot_write_ends_only_the_requests_admitted_into_that_slot(one_slot, monkeypatch):
    """The pool, the prefix cache and the other requests are left alone; the slot holds nothing until a later
    sequence's write fills it. Retrying the write instead could fail the same way every step."""
    if one_slot.loras.slots.holders[0] == one_slot.adapters["qv_rslora"]:
        run_all(one_slot, ["all_modules"], "one_token")  # so that qv_rslora is swapped in
    base, case = case_named(BASE["cases"], "forty_tokens"), case_named(ADAPTERS["qv_rslora"]["cases"], "short")
    base_sink, lora_sink = ListCollector(1), ListCollector(1)
    one_slot.submit([base["prompt_ids"]], golden_params(BASE), base_sink, "base")
    for _ in range(4):
        one_slot.step()
    write = one_slot.runner.write_layer_rows
    calls = []

    def failing_once(rows, slot):
        calls.append(slot)
        if len(calls) == 1:
            raise MemoryError("out of device memory writing a LoRA slot")
        write(rows, slot)

    monkeypatch.setattr(one_slot.runner, "write_layer_rows", failing_once)
    failures = one_slot.stats.num_step_failures
    one_slot.submit([case["prompt_ids"]], golden_params(LORA, lora=one_slot.adapters["qv_rslora"]), lora_sink, "lora")
    one_slot.step()
    assert calls == [0] and one_slot.loras.slots.holders == [None] and not one_slot.loras.slots.writes
    drain(one_slot)
    [lora] = lora_sink.completions()
    assert lora.finish_reason == "error" and "out of device memory writing a LoRA slot" in lora.error
    [output] = base_sink.completions()
    assert_completion_gives_case(output, base)
    assert one_slot.stats.num_step_failures == failures and one_slot.loras.slots.users == [0]
    run_all(one_slot, ["qv_rslora"], "short")


def test_a_lora_request_built_by_hand_runs_with_the_served_adapters_weights(one_slot):
    """Equal to the served one (name and fingerprint), without weights: the engine runs the served one."""
    served = one_slot.adapters["qv_rslora"]
    if one_slot.loras.slots.holders[0] == served:
        run_all(one_slot, ["all_modules"], "one_token")  # so that qv_rslora is swapped in
    case = case_named(ADAPTERS["qv_rslora"]["cases"], "short")
    [[output]] = generate(one_slot, [case["prompt_ids"]], [golden_params(BASE, lora=LoraRequest(
        "qv_rslora", served.fingerprint))])
    assert_completion_gives_case(output, case)
    run_all(one_slot, ["qv_rslora"], "short", cache_salt="served")


def test_a_slot_write_refuses_rows_that_leave_a_lora_parameter_out(one_slot):
    weights = one_slot.adapters["all_modules"].weights
    with pytest.raises(ValueError, match="LoRA"):
        one_slot.runner.write_layer_rows({}, 0)
    with pytest.raises(ValueError, match="LoRA"):
        one_slot.runner.write_layer_rows(dict(list(weights.items())[1:]), 0)


def test_several_choices_of_requests_of_two_adapters_share_one_slot_in_turn(one_slot, monkeypatch):
    steps = record_steps(one_slot, monkeypatch)
    run_all(one_slot, ["all_modules", "qv_rslora", None, "all_modules"], "short", n=2)
    assert all(len(adapters(step)) <= 1 for step in steps) and one_slot.loras.slots.users == [0]


def test_an_aborted_request_gives_its_slot_to_the_adapter_waiting_for_it(one_slot):
    cases = {name: case_named(ADAPTERS[name]["cases"], "forty_tokens") for name in FOLDERS}
    sinks = {name: ListCollector(1) for name in FOLDERS}
    for name in FOLDERS:
        one_slot.submit([cases[name]["prompt_ids"]], golden_params(LORA, lora=one_slot.adapters[name]), sinks[name],
                        name)
    one_slot.step()
    [running] = one_slot.stats.lora_running
    [waiting] = one_slot.stats.lora_waiting
    one_slot.abort(running)
    drain(one_slot)
    [aborted] = sinks[running].completions()
    assert aborted.finish_reason == "abort"
    [output] = sinks[waiting].completions()
    assert_completion_gives_case(output, cases[waiting])
    assert one_slot.loras.slots.users == [0] and one_slot.loras.slots.holders == [one_slot.adapters[waiting]]


def test_an_adapter_waiting_for_the_slot_runs_though_requests_for_the_adapter_in_it_keep_coming(one_slot):
    first, other = FOLDERS
    sinks = [ListCollector(1) for _ in range(50)]  # far more steps than the waiting request needs

    def submit(i: int, name: str) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora=one_slot.adapters[name])
        one_slot.submit([[1, 2, 3, 4, 5]], params, sinks[i], f"steady-{i}")

    submit(0, first)
    one_slot.step()
    submit(1, other)
    for i in range(2, len(sinks)):
        if sinks[1].completions()[0].finish_reason is not None:
            break
        submit(i, first)
        one_slot.step()
    assert sinks[1].completions()[0].finish_reason == "length"
    drain(one_slot)
    assert one_slot.loras.slots.users == [0]


def test_no_more_slots_than_adapters_without_runtime_updating_and_max_loras_still_reported(folder):
    """Every token multiplies every slot's weights: an empty slot would cost as much as a full one."""
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=MODULES, max_loras=8)
    assert engine.loras.slots.num_slots == len(MODULES)
    assert {leaf.shape[1] for path, leaf in jax.tree_util.tree_flatten_with_path(engine.runner.state)[0]
            if path[0].key in LORA_PARAMS} == {len(MODULES)}
    run_all(engine, ["qv_rslora", "all_modules"], "one_token")
    assert engine.stats.max_loras == 8


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
    order = ["all_modules", "all_modules", "qv_rslora"]  # the third waits for the slot the others hold
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
    drain(engine)
    for name, sink in zip(order, sinks):
        [output] = sink.completions()
        assert_completion_gives_case(output, cases[name])
    assert engine.loras.slots.users == [0]


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
    """Alone it implies --enable-lora, as --max-loras and --max-lora-rank do."""
    config = engine_config(flags)
    assert config.enable_lora and config.max_cpu_loras == int(flags[-1])


def test_max_cpu_loras_without_lora_is_refused_by_the_engine_config():
    with pytest.raises(InvalidEngineConfig, match=r"max_cpu_loras needs enable_lora \(or lora_modules\), got 2"):
        EngineConfig(max_cpu_loras=2)


def test_max_cpu_loras_below_one_is_refused_by_the_engine_config():
    with pytest.raises(InvalidEngineConfig, match="max_cpu_loras must be at least 1"):
        EngineConfig(enable_lora=True, max_cpu_loras=0)


def test_host_memory_keeps_the_weights_of_the_max_held_adapters_used_last():
    """Equal adapters (one loaded again with the same files) are other objects, each with weights of its own."""
    a, b, c, a_again = (LoraRequest(name, name[0] * 64, weights={"w": np.ones(2)}) for name in ["a", "b", "c", "a"])
    slots = LoraSlots(1, [a], max_held=2)
    slots.hold([a, b, c])
    assert [bool(lora.weights) for lora in (a, b, c)] == [False, True, True]
    slots.hold([b])
    slots.hold([a_again])
    assert [bool(lora.weights) for lora in (b, c, a_again)] == [True, False, True]
    assert list(slots.held.values()) == [b, a_again]


def test_without_max_held_host_memory_keeps_every_adapters_weights():
    loras = [LoraRequest(name, name * 64, weights={"w": np.ones(2)}) for name in "abc"]
    slots = LoraSlots(1, loras[:1])
    slots.hold(loras)
    assert all(lora.weights for lora in loras)


def three_adapters(parent: Path) -> tuple[tuple[str, str], ...]:
    """Three adapters in folders of their own under `parent` (`--lora-modules`' pairs): the two tiny ones, and
    all_modules at twice its lora_alpha ("doubled": another adapter, of other tokens)."""
    folders = {name: Path(shutil.copytree(path, parent / name)) for name, path in MODULES}
    folders["doubled"] = Path(shutil.copytree(folders["all_modules"], parent / "doubled"))
    scale_alpha(folders["doubled"], 2)
    return tuple((name, str(path)) for name, path in folders.items())


def scale_alpha(adapter: Path, factor: int = 3) -> None:
    """Rewrites the adapter's adapter_config.json with `factor` times its lora_alpha: other files, another adapter."""
    settings = json.loads((adapter / CONFIG_FILE).read_text())
    (adapter / CONFIG_FILE).write_text(json.dumps(settings | {"lora_alpha": factor * settings["lora_alpha"]}))


def held(engine: Engine) -> set[str]:
    """The served adapters whose weights host memory holds, by name."""
    return {name for name, lora in engine.adapters.items() if lora.weights}


def record_held(engine: Engine, monkeypatch) -> list[int]:
    """At each step the engine dispatches, how many adapters' weights host memory holds, of those served, those the
    step runs with and those its slots hold."""
    counts = []
    dispatch = engine.runner.dispatch

    def recording(chunks, *args, **kwargs):
        loras = [*engine.adapters.values(), *(chunk.seq.params.lora for chunk in chunks), *engine.loras.slots.holders]
        counts.append(len({id(lora): lora for lora in loras if lora is not None and lora.weights}))
        return dispatch(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    return counts


def run_one_by_one(engine: Engine, names: list[str | None], prompt: list[int]) -> list[Completion]:
    """A greedy run of `prompt` with each adapter of `names` in turn (None: the base), each run on its own."""
    return [generate(engine, [prompt], [golden_params(BASE, lora=engine.adapters.get(name))])[0][0]
            for name in names]


def test_at_most_max_cpu_loras_adapters_weights_stay_in_host_memory_the_least_recently_used_dropped(
        folder, tmp_path, monkeypatch):
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=three_adapters(tmp_path), max_loras=1,
                           max_cpu_loras=2)
    assert held(engine) == {"qv_rslora", "doubled"}  # all_modules' weights are in its slot
    counts = record_held(engine, monkeypatch)
    outputs = run_one_by_one(engine, ["qv_rslora", "doubled", "all_modules", None, "qv_rslora"],
                             case_named(BASE["cases"], "short")["prompt_ids"])
    assert all(output.finish_reason == "length" for output in outputs)
    assert counts and max(counts) <= 2
    assert held(engine) == {"all_modules", "qv_rslora"} and len(engine.loras.slots.held) == 2


def test_adapters_read_again_from_their_folders_give_the_tokens_of_adapters_kept_in_host_memory(folder, tmp_path):
    """Also with fewer adapters held than slots (the engine config allows it, the CLI does not): a read is taken in
    between steps, never between a sequence's admission and its slot's write, so it drops no weights a write needs."""
    modules = three_adapters(tmp_path)
    names = ["doubled", "all_modules", None, "qv_rslora", "doubled", "all_modules", "qv_rslora"]
    prompts = [[(5 * i + j) % 300 + 3 for j in range(20)] for i in range(len(names))]
    runs = []
    for max_loras, bound in [(1, 2), (2, 1), (1, None)]:
        engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=modules, max_loras=max_loras,
                               max_cpu_loras=bound)
        together = generate(engine, prompts, [golden_params(BASE, lora=engine.adapters.get(name)) for name in names])
        runs.append([output for [output] in together] + run_one_by_one(engine, names, prompts[0]))
        assert engine.stats.num_step_failures == 0
    *bounded, in_memory = runs
    for run in bounded:
        assert [(o.token_ids, o.logprobs) for o in run] == [(o.token_ids, o.logprobs) for o in in_memory]
    assert len({o.token_ids for o, name in zip(in_memory, names) if name is not None}) > 1


def test_an_adapter_read_again_keeps_the_engine_stepping_the_other_requests_then_gives_its_tokens(
        folder, tmp_path, monkeypatch):
    """all_modules' weights were dropped, qv_rslora took the one slot: its next request waits while its files are
    read again on another thread, and a request of the base model runs to its end meanwhile."""
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=three_adapters(tmp_path), max_loras=1,
                           max_cpu_loras=2)
    run_all(engine, ["qv_rslora"], "one_token")
    gate, readers = threading.Event(), []
    monkeypatch.setattr(lora_registry, "read_adapter",
                        partial(read_when(gate, readers), wraps=lora_registry.read_adapter))
    base, case = case_named(BASE["cases"], "short"), case_named(ADAPTERS["all_modules"]["cases"], "short")
    sinks = [ListCollector(1), ListCollector(1)]
    for i, (case_, params) in enumerate([(case, golden_params(LORA, lora=engine.adapters["all_modules"])),
                                         (base, golden_params(BASE))]):
        engine.submit([case_["prompt_ids"]], params, sinks[i], f"r{i}")
    for _ in range(MAX_STEPS):
        if sinks[1].completions()[0].finish_reason is not None:
            break
        engine.step()
    assert readers and readers[0] is not threading.current_thread()
    assert [seq.params.lora.name for seq in engine.scheduler.waiting] == ["all_modules"] and not gate.is_set()
    assert_completion_gives_case(sinks[1].completions()[0], base)
    gate.set()
    drain(engine)
    assert_completion_gives_case(sinks[0].completions()[0], case)
    assert len(readers) == 1 and engine.stats.num_step_failures == 0


def delete(adapter: Path) -> None:
    shutil.rmtree(adapter)


def cut_short(adapter: Path) -> None:
    (adapter / WEIGHTS_FILE).write_bytes((adapter / WEIGHTS_FILE).read_bytes()[:100])


@pytest.mark.parametrize("edit, words", [(delete, "no such folder"), (cut_short, "does not read as safetensors"),
                                         (scale_alpha, "files changed since it was loaded")],
                         ids=["deleted", "corrupted", "changed"])
def test_an_adapter_whose_files_cannot_be_read_again_fails_only_its_request(folder, tmp_path, edit, words):
    """all_modules starts in the slot, its weights not in host memory; once qv_rslora took the slot, all_modules'
    request needs its files read again."""
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=three_adapters(tmp_path), max_loras=1,
                           max_cpu_loras=2)
    run_all(engine, ["qv_rslora"], "one_token")
    edit(tmp_path / "all_modules")
    base, case = case_named(BASE["cases"], "short"), case_named(ADAPTERS["qv_rslora"]["cases"], "short")
    [[broken], [other], [plain]] = generate(
        engine, [case["prompt_ids"], case["prompt_ids"], base["prompt_ids"]],
        [golden_params(LORA, lora=engine.adapters[name]) for name in ["all_modules", "qv_rslora"]]
        + [golden_params(BASE)])
    assert broken.finish_reason == "error" and "LoRA adapter 'all_modules'" in broken.error and words in broken.error
    assert_completion_gives_case(other, case)
    assert_completion_gives_case(plain, base)
    assert engine.stats.num_step_failures == 0 and engine.loras.slots.users == [0]
    assert "all_modules" in engine.adapters  # still served: a later request reads its files again
    run_all(engine, ["qv_rslora"], "short")


def test_adapters_loaded_and_unloaded_at_runtime_stay_within_max_cpu_loras(folder, monkeypatch):
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_loras=1,
                           max_lora_rank=8, max_cpu_loras=2)
    files = {"all_modules": "all_modules", "qv_rslora": "qv_rslora", "qv_again": "qv_rslora"}  # name -> adapter
    for name, adapter in files.items():
        engine.load_lora(name, FOLDERS[adapter])
        engine.step()
    assert held(engine) == {"qv_rslora", "qv_again"}
    counts = record_held(engine, monkeypatch)

    def run(name: str) -> None:
        case = case_named(ADAPTERS[files[name]]["cases"], "short")
        [[output]] = generate(engine, [case["prompt_ids"]], [golden_params(LORA, lora=engine.adapters[name])])
        assert_completion_gives_case(output, case | {"name": f"{name}: {case['name']}"})

    for name in ["all_modules", "qv_again", "qv_rslora", "all_modules"]:
        run(name)
    engine.unload_lora("qv_rslora")
    files["all_again"] = "all_modules"
    engine.load_lora("all_again", FOLDERS["all_modules"])
    engine.step()
    assert "all_again" in held(engine) and "qv_rslora" not in engine.adapters
    for name in ["qv_again", "all_again", "all_modules"]:
        run(name)
    assert counts and max(counts) <= 2 and len(engine.loras.slots.held) == 2


@pytest.mark.parametrize("max_cpu_loras", [None, 3], ids=["unset", "every-adapter"])
def test_without_a_bound_below_the_adapters_served_no_adapters_weights_are_dropped_or_read_again(
        folder, tmp_path, max_cpu_loras):
    engine = golden_engine(fresh(folder), enable_lora=True, lora_modules=three_adapters(tmp_path), max_loras=1,
                           max_cpu_loras=max_cpu_loras)
    first = {name: dict(lora.weights) for name, lora in engine.adapters.items()}
    run_one_by_one(engine, ["qv_rslora", "doubled", "all_modules", "doubled", "qv_rslora"],
                   case_named(BASE["cases"], "short")["prompt_ids"])
    for name, lora in engine.adapters.items():
        assert lora.weights.keys() == first[name].keys() and first[name]
        assert all(lora.weights[key] is weight for key, weight in first[name].items()), name


def test_an_adapter_no_longer_served_is_forgotten_by_host_memory_even_in_a_slot():
    """Its weights are dropped at once, and its place among the held is a served adapter's: a slot holding it
    keeps its rows on the device, which is all a sequence still running or admitted with it needs."""
    a, b = (LoraRequest(name, name * 64, weights={"w": np.ones(2)}) for name in "ab")
    slots = LoraSlots(1, [a], max_held=2)
    slots.hold([a, b])
    slots.forget(a)
    assert not a.weights and list(slots.held.values()) == [b] and slots.holders == [a]


def test_without_max_held_an_adapter_no_longer_served_keeps_its_weights_for_the_requests_that_run_with_it():
    a = LoraRequest("a", "a" * 64, weights={"w": np.ones(2)})
    slots = LoraSlots(1, [a])
    slots.forget(a)
    assert a.weights


@pytest.mark.parametrize("update", ["unload b, load c", "load b in place"])
def test_an_adapter_unloaded_or_replaced_takes_no_place_of_a_served_one_in_host_memory(folder, update):
    """vLLM's remove_adapter drops the adapter from its CPU cache: --max-cpu-loras' places are the served
    adapters'."""
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_loras=1,
                           max_lora_rank=8, max_cpu_loras=2)
    for name, adapter in [("a", "all_modules"), ("b", "qv_rslora")]:
        engine.load_lora(name, FOLDERS[adapter])
        engine.step()
    old_b = engine.adapters["b"]
    if update == "unload b, load c":
        engine.unload_lora("b")
        engine.load_lora("c", FOLDERS["qv_rslora"])
    else:
        engine.load_lora("b", FOLDERS["qv_rslora"])
    engine.step()
    assert held(engine) == set(engine.adapters), "a served adapter's weights were dropped, two places being free"
    assert id(old_b) not in engine.loras.slots.held and not old_b.weights


def test_an_adapter_whose_requests_keep_being_admitted_is_not_the_one_host_memory_drops(folder):
    """vLLM touches its CPU cache each time an adapter is activated: admitted into the slot that already holds it,
    an adapter is used as much as one written there."""
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_loras=1,
                           max_lora_rank=8, max_cpu_loras=2)
    case = case_named(ADAPTERS["qv_rslora"]["cases"], "short")
    for name in ["a", "b", "c"]:  # a is written into the slot, then admitted there again after b is loaded
        engine.load_lora(name, FOLDERS["qv_rslora"])
        engine.step()
        [[output]] = generate(engine, [case["prompt_ids"]], [golden_params(LORA, lora=engine.adapters["a"])])
        assert_completion_gives_case(output, case)
    assert held(engine) == {"a", "c"}


def replace_in_place(engine: Engine, folder: Path) -> None:
    scale_alpha(folder)  # new files, loaded in place
    engine.load_lora("x", str(folder))


def unload_and_delete(engine: Engine, folder: Path) -> None:
    engine.unload_lora("x")
    shutil.rmtree(folder)


@pytest.mark.parametrize("update, words", [(replace_in_place, "replaced"), (unload_and_delete, "unloaded")],
                         ids=["load_inplace", "unload"])
@pytest.mark.parametrize("max_cpu_loras", [None, 1], ids=["unset", "one"])
def test_a_request_waiting_when_its_adapter_is_replaced_or_unloaded_finishes_with_it_while_host_memory_holds_it(
        folder, tmp_path, max_cpu_loras, update, words):
    """Unset, host memory keeps the old adapter's weights for the requests that run or wait with it. With
    --max-cpu-loras they may have been dropped, and its files, rewritten or deleted, no longer give them (vLLM would
    read the new files): the waiting request ends with an error that says why, and no other."""
    engine = golden_engine(fresh(folder), enable_lora=True, allow_runtime_lora_updating=True, max_loras=1,
                           max_lora_rank=8, max_cpu_loras=max_cpu_loras)
    x_folder = Path(shutil.copytree(FOLDERS["qv_rslora"], tmp_path / "x"))
    for name, path in [("x", str(x_folder)), ("y", FOLDERS["all_modules"])]:
        engine.load_lora(name, path)
        engine.step()
    y_case = case_named(ADAPTERS["all_modules"]["cases"], "short")
    x_case = case_named(ADAPTERS["qv_rslora"]["cases"], "short")
    sinks = [ListCollector(1), ListCollector(1)]
    for i, (name, case) in enumerate([("y", y_case), ("x", x_case)]):
        engine.submit([case["prompt_ids"]], golden_params(LORA, lora=engine.adapters[name]), sinks[i], f"r{i}")
    engine.step()  # y's request runs in the one slot; x's, taken in, waits for it
    assert [seq.params.lora.name for seq in engine.scheduler.waiting] == ["x"]
    update(engine, x_folder)
    drain(engine)
    [[y_out], [x_out]] = [sink.completions() for sink in sinks]
    assert_completion_gives_case(y_out, y_case)
    if max_cpu_loras is None:
        assert_completion_gives_case(x_out, x_case)
    else:
        said = f"LoRA adapter 'x' was {words} after this request was taken in, and its files ({x_folder}) no longer"
        assert x_out.finish_reason == "error" and said in x_out.error
    assert engine.stats.num_step_failures == 0 and engine.loras.slots.users == [0]


def test_a_load_on_an_engine_without_lora_slots_is_refused_before_its_files_are_read(folder):
    """No adapter given, no runtime updating: no slot could serve it (the engine thread would fail on it)."""
    engine = golden_engine(fresh(folder), enable_lora=True)
    with pytest.raises(LoraError, match="LoRA adapter 'a' .*no LoRA slots"):
        engine.load_lora("a", "/no/such/folder")
    engine.step()
    assert not engine.adapters
