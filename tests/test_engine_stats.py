"""The stats snapshot's summed fields, which let a reader sampling at its own pace rebuild per-step facts:
FLOPs and bytes of each step from its geometry, decode batch sizes, busy time and queue waits."""

import time

import jax
import pytest
from flax import nnx

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.scheduler import ScheduledChunk
from sluice.batching.stats import StepStats
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from sluice.model.roofline import StepCost, matmul_weights
from sequences import make_sequence

TINY = ModelConfig.tiny()
COST = StepCost(flops_per_token=10.0, flops_per_attended_key=1.0, weight_bytes=1000.0, kv_bytes_per_token=2.0)


def chunk(num_prompt: int, start: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(make_sequence(0, list(range(3, 3 + num_prompt))), start, num_tokens)


def test_a_step_costs_its_tokens_attended_keys_and_one_read_of_weights_and_context():
    # A prefill chunk of 4 from position 0 (1+2+3+4 keys) and a decode at position 9 (10 keys).
    step = StepStats.of([chunk(4, 0, 4), chunk(10, 9, 1)], None, COST)
    assert step.flops == 10 * 5 + (10 + 10)
    assert step.bytes == 1000 + 2 * (4 + 10)
    assert (step.num_decode_seqs, step.num_prefill_tokens) == (1, 4)


def test_a_multi_step_call_costs_a_weight_read_per_pass_and_a_growing_context():
    # Two decodes at positions 9 and 4, running 3 and 2 passes: keys 10+11+12 and 5+6.
    step = StepStats.of([chunk(10, 9, 1), chunk(5, 4, 1)], [3, 2], COST)
    assert step.flops == 10 * 5 + 44
    assert step.bytes == 1000 * 3 + 2 * 44


def test_step_cost_counts_two_flops_per_matmul_weight_and_the_stored_weight_bytes():
    model = Llama(TINY, rngs=nnx.Rngs(0))
    cost = StepCost.of(TINY, model, kv_dtype="float32")
    assert cost.flops_per_token == 2 * matmul_weights(TINY)
    # Untied: the embedding table is read by rows, not whole.
    embed = TINY.vocab_size * TINY.hidden_size * 4
    total = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model)))
    assert cost.weight_bytes == total - embed


@pytest.fixture(scope="module")
def engine(smollm2) -> Engine:
    loaded = LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), smollm2.tokenizer, "tiny")
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=4,
                          kv_cache_memory=1 << 20, num_decode_steps=1, warmup=False)
    return Engine(loaded, config, progress=False)


def test_engine_sums_step_costs_busy_time_and_decode_batch_sizes(engine):
    before = engine.stats
    engine.generate([[5, 6, 7]] * 6, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    after = engine.stats
    steps = [a - b for a, b in zip(after.decode_batch_steps, before.decode_batch_steps)]
    assert len(steps) == 4 + 1  # batch sizes 0..max_num_seqs
    decoded = sum(size * count for size, count in enumerate(steps))
    assert decoded == 6 * 4  # every output token but each sequence's first (sampled by its prefill)
    assert after.busy_s > before.busy_s and after.flops > before.flops and after.bytes > before.bytes


def test_busy_time_counts_each_moment_once_when_steps_overlap(engine):
    # Overlapped (the default), a step is dispatched before the one before it is collected; the time between
    # counts once, for that one, so busy time never exceeds the time spent stepping.
    before = engine.stats
    start = time.perf_counter()
    engine.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    elapsed = time.perf_counter() - start
    assert 0 < engine.stats.busy_s - before.busy_s <= elapsed


def test_every_admitted_sequence_counts_its_queue_wait(engine):
    before = engine.stats
    engine.generate([[5, 6, 7]] * 6, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    after = engine.stats
    assert after.num_admitted - before.num_admitted == 6
    assert after.queue_wait_s > before.queue_wait_s
