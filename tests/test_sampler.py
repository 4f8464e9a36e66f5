"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties, banned ids, per-row seeds, logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sluice.batching.sampler import EVERY_PASS, SamplerPlan, argmax, filter_cutoff, inverse_cdf, sample
from sluice.batching.sampling_params import SamplingParams
from sampling_rows import Row, sampling_batch

VOCAB = 64
sample_jit = jax.jit(sample)


def logits_for(num_rows: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (num_rows, VOCAB), jnp.float32) * 3


def run(logits, rows: list[Row], num_rows=None, history_len=32):
    batch = sampling_batch(rows, num_rows or logits.shape[0], VOCAB, history_len)
    return jax.tree.map(np.asarray, sample_jit(logits, batch))


def row(params: SamplingParams, seed: int = 0, step: int = 0, tokens=(), num_prompt=0, stop_ids=()) -> Row:
    return Row(params, seed, step, tuple(tokens), num_prompt, tuple(stop_ids))


def test_greedy_takes_the_argmax():
    logits = logits_for(4)
    out = run(logits, [row(SamplingParams(temperature=0.0))] * 4)
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))


def test_seeded_row_samples_the_same_token_whatever_else_is_in_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9)
    target = logits_for(1, seed=1)[0]
    alone = run(target[None], [row(params, seed=1234, step=5)])
    others = logits_for(7, seed=2)
    crowd_logits = jnp.concatenate([others[:3], target[None], others[3:]])
    crowd_rows = [row(SamplingParams(temperature=0.5, top_k=3), seed=i) for i in range(3)]
    crowd_rows += [row(params, seed=1234, step=5)] + [row(SamplingParams(temperature=0.0))] * 4
    crowd = run(crowd_logits, crowd_rows, num_rows=8)
    assert crowd.tokens[3] == alone.tokens[0]


def test_seed_and_step_change_the_draw():
    logits = jnp.zeros((1, VOCAB))  # uniform: any two draws agreeing 20 times is vanishingly unlikely
    params = SamplingParams(temperature=1.0)
    by_step = {int(run(logits, [row(params, seed=7, step=s)]).tokens[0]) for s in range(20)}
    by_seed = {int(run(logits, [row(params, seed=s, step=0)]).tokens[0]) for s in range(20)}
    assert len(by_step) > 5 and len(by_seed) > 5


def test_temperature_sampling_follows_the_softmax():
    num_rows = 4000
    base = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)))
    logits = jnp.tile(base, (num_rows, 1))
    out = run(logits, [row(SamplingParams(temperature=1.0), seed=s) for s in range(num_rows)])
    freq = np.bincount(out.tokens, minlength=VOCAB)[:4] / num_rows
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6),
     SamplingParams(temperature=2.0, min_p=1.0)],
    ids=["top_k=1", "top_p~0", "min_p=1"],
)
def test_tightest_filters_reduce_to_greedy(params):
    logits = logits_for(16)
    out = run(logits, [row(params, seed=s) for s in range(16)])
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))


def test_top_k_keeps_only_the_k_best():
    logits = logits_for(1)
    best3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    drawn = {int(run(logits, [row(SamplingParams(temperature=2.0, top_k=3), seed=s)]).tokens[0]) for s in range(40)}
    assert drawn <= best3 and len(drawn) > 1


def test_stop_ids_are_banned_until_min_tokens_then_end_the_row():
    logits = jnp.zeros((2, VOCAB)).at[:, 5].set(100.0)
    params = SamplingParams(temperature=0.0, min_tokens=3)
    early, due = row(params, step=2, stop_ids=(5, 9)), row(params, step=3, stop_ids=(5, 9))
    out = run(logits, [early, due])
    assert out.tokens[0] != 5 and out.tokens[1] == 5
    batch = sampling_batch([early, due], 2, VOCAB)
    np.testing.assert_array_equal(batch.stops(jnp.asarray([5, 5])), [False, True])


def test_advancing_appends_the_token_to_histories_that_are_read():
    reads = row(SamplingParams(presence_penalty=1.0), step=1, tokens=[7, 8, 9], num_prompt=2)
    batch = jax.tree.map(jnp.asarray, sampling_batch([reads, row(SamplingParams())], 2, VOCAB, 6))
    batch = batch.advanced(jnp.asarray([4, 5]))
    np.testing.assert_array_equal(batch.step, [2, 1])
    np.testing.assert_array_equal(batch.history, [[7, 8, 9, 4, -1, -1], [-1] * 6])


def test_repetition_penalty_demotes_tokens_seen_in_the_prompt():
    logits = jnp.zeros((1, VOCAB)).at[0, 3].set(2.0).at[0, 4].set(1.5)
    plain = run(logits, [row(SamplingParams(temperature=0.0))])
    penalised = run(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=2.0), tokens=[3], num_prompt=1)])
    assert plain.tokens[0] == 3 and penalised.tokens[0] == 4


def test_presence_and_frequency_penalties_count_only_output_tokens():
    logits = jnp.zeros((1, VOCAB)).at[0, 3].set(2.0).at[0, 4].set(1.5)
    prompt_only = run(logits, [row(SamplingParams(temperature=0.0, presence_penalty=1.0), tokens=[3], num_prompt=1)])
    in_output = run(logits, [row(SamplingParams(temperature=0.0, presence_penalty=1.0), tokens=[9, 3], num_prompt=1)])
    frequent = run(logits, [row(SamplingParams(temperature=0.0, frequency_penalty=0.3), tokens=[9, 3, 3], num_prompt=1)])
    assert prompt_only.tokens[0] == 3 and in_output.tokens[0] == 4 and frequent.tokens[0] == 4


def test_logit_bias_shifts_a_rows_logits_before_sampling_but_not_its_logprobs():
    logits = jnp.zeros((3, VOCAB)).at[:, 3].set(2.0).at[:, 4].set(1.5)
    banned = row(SamplingParams(temperature=0.0, logprobs=True, logit_bias=((3, -100.0),)))
    chosen = row(SamplingParams(temperature=0.0, logit_bias=((9, 100.0), (4, 1.0))))
    out = run(logits, [banned, chosen, row(SamplingParams(temperature=0.0))])
    np.testing.assert_array_equal(out.tokens, [4, 9, 3])
    expected = np.asarray(jax.nn.log_softmax(logits[0]))
    np.testing.assert_allclose(out.logprobs[0], expected[4], rtol=1e-6)  # the model's own distribution
    sampled = {int(run(logits[:1], [row(SamplingParams(temperature=1.0, logit_bias=((20, 100.0),)), seed=s)]).tokens[0])
               for s in range(10)}
    assert sampled == {20}


def test_allowed_token_ids_are_all_a_row_may_sample_with_its_logit_bias_and_logprobs_stay_the_models():
    logits = jnp.zeros((3, VOCAB)).at[:, 3].set(2.0).at[:, 7].set(1.0).at[:, 8].set(0.5)
    only = row(SamplingParams(temperature=0.0, logprobs=True, allowed_token_ids=(8, 7)))
    biased = row(SamplingParams(temperature=0.0, allowed_token_ids=(7, 8), logit_bias=((8, 5.0), (3, 50.0))))
    out = run(logits, [only, biased, row(SamplingParams(temperature=0.0))])
    np.testing.assert_array_equal(out.tokens, [7, 8, 3])  # 3, outside the allowed ids, whatever its bias
    np.testing.assert_allclose(out.logprobs[0], jax.nn.log_softmax(logits[0])[7], rtol=1e-6)
    sampled = {int(run(logits[:1], [row(SamplingParams(temperature=1.5, allowed_token_ids=(11, 12, 13)), seed=s)])
                   .tokens[0]) for s in range(20)}
    assert sampled == {11, 12, 13}


def test_logprobs_are_the_models_log_softmax_with_the_best_first():
    logits = logits_for(2)
    out = run(logits, [row(SamplingParams(temperature=1.0, logprobs=True, top_logprobs=5), seed=3)] * 2)
    expected = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(out.logprobs, expected[np.arange(2), out.tokens], rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids[:, 0], np.argmax(expected, -1))
    assert np.all(np.diff(out.top_logprobs, axis=-1) <= 0)


def test_top_k_beyond_the_vocabulary_means_no_filter():
    logits = logits_for(1)
    unfiltered = row(SamplingParams(temperature=1.0), seed=5)
    huge = row(SamplingParams(temperature=1.0, top_k=2**40), seed=5)
    assert sampling_batch([huge], 1, VOCAB).top_k[0] == 0
    assert run(logits, [huge]).tokens[0] == run(logits, [unfiltered]).tokens[0]


def test_argmax_is_the_first_index_of_the_maximum_whatever_the_width():
    logits = jax.random.normal(jax.random.key(3), (5, 1000)).at[1, 7].set(9.0).at[1, 900].set(9.0)
    np.testing.assert_array_equal(argmax(logits), np.argmax(np.asarray(logits), -1))


def test_top_p_and_top_k_cutoffs_equal_a_sorted_reference():
    logits = np.asarray(jax.random.normal(jax.random.key(4), (6, VOCAB)) * 2)
    params = [SamplingParams(temperature=1.0, top_p=p, top_k=k) for p, k in
              [(0.5, 0), (0.9, 0), (1.0, 7), (0.8, 10), (0.3, 3), (0.999, 0)]]
    batch = sampling_batch([row(p) for p in params], 6, VOCAB, 8)
    cutoff = np.asarray(jax.jit(filter_cutoff)(jnp.asarray(logits), batch))[:, 0]
    for i, p in enumerate(params):
        desc = np.sort(logits[i])[::-1]
        kept = desc[:p.top_k] if p.top_k else desc
        probs = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
        num_kept = max(1, int(np.sum(np.cumsum(probs) - probs < p.top_p)))
        assert cutoff[i] == kept[num_kept - 1], i


def test_sampled_tokens_follow_the_filtered_distribution():
    num_rows = 4000
    base = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1] + [1e-9] * (VOCAB - 4)))
    out = run(jnp.tile(base, (num_rows, 1)), [row(SamplingParams(temperature=1.0, top_p=0.75), seed=s)
                                               for s in range(num_rows)])
    freq = np.bincount(out.tokens, minlength=VOCAB)[:4] / num_rows
    np.testing.assert_allclose(freq, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0], atol=0.03)



def test_a_draw_never_takes_a_token_of_zero_probability():
    """Draws next to each 128-token block's cumulative mass, where a block's sum and its running sum round apart:
    a token a filter, a ban or a grammar left at zero probability is never the one taken (every draw
    jax.random.uniform can make: multiples of 2**-23)."""
    rng = np.random.default_rng(0)
    vocab = 512
    probs = rng.random((40, vocab)).astype(np.float32) ** 4
    probs[rng.random(probs.shape) < 0.3] = 0
    probs[:, np.arange(vocab) % 128 >= 100] = 0  # each block ends with masked tokens
    probs = (probs / probs.sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    mass = np.cumsum(probs.reshape(40, -1, 128).sum(-1), axis=-1)
    grid = np.round(mass[:, :, None] * 2**23) + np.arange(-64, 65)
    draws = (np.clip(grid, 0, 2**23 - 1) / 2**23).astype(np.float32).reshape(40, -1)
    rows = np.repeat(np.arange(40), draws.shape[1])
    tokens = np.asarray(jax.jit(inverse_cdf)(jnp.asarray(probs[rows]), jnp.asarray(draws.reshape(-1))))
    assert np.all(probs[rows, tokens] > 0)

PLAN_CASES = {
    "greedy": ([row(SamplingParams(temperature=0.0))] * 4, SamplerPlan()),
    "sampling": ([row(SamplingParams(temperature=0.8), seed=s) for s in range(4)], SamplerPlan(sampling=True)),
    "filters and penalties": (
        [row(SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, presence_penalty=0.5,
                            repetition_penalty=1.2), seed=s, tokens=(1, 2, 3, 1), num_prompt=2) for s in range(3)]
        + [row(SamplingParams(temperature=0.0, top_k=3))],
        SamplerPlan(sampling=True, penalties=True, top_k=True, top_p=True, min_p=True)),
    "drafts and top logprobs": (
        [Row(SamplingParams(temperature=0.9, top_logprobs=5), seed=s, draft=s + 3) for s in range(2)]
        + [Row(SamplingParams(temperature=0.0, logprobs=True), draft=7), row(SamplingParams(temperature=0.0))],
        SamplerPlan(sampling=True, top_logprobs=True)),
    "logit bias": (
        [row(SamplingParams(temperature=0.0, logit_bias=((5, 4.0), (6, -100.0)))),
         row(SamplingParams(temperature=0.9, logit_bias=((1, 2.5),)), seed=2), row(SamplingParams(temperature=0.0)),
         row(SamplingParams(temperature=0.9, allowed_token_ids=(2, 9)), seed=3)],
        SamplerPlan(sampling=True, logit_bias=True)),
    "min tokens": (
        [row(SamplingParams(temperature=0.0, min_tokens=3), step=1, stop_ids=(5, 9)),
         row(SamplingParams(temperature=0.8, min_tokens=2), seed=5, step=4, stop_ids=(5,)),
         row(SamplingParams(temperature=0.0))],
        SamplerPlan(sampling=True, min_tokens=True)),
}


def test_the_plan_for_parameters_is_that_of_their_rows():
    assert SamplerPlan.for_params(SamplingParams(temperature=0.0), VOCAB) == SamplerPlan()
    assert SamplerPlan.for_params(SamplingParams(temperature=0.8, top_p=0.9), VOCAB) == SamplerPlan(sampling=True,
                                                                                                  top_p=True)
    assert SamplerPlan.for_params(SamplingParams(temperature=0.0, top_k=5, logprobs=True, top_logprobs=2,
                                                 repetition_penalty=1.1), VOCAB) == SamplerPlan(penalties=True,
                                                                                                 top_logprobs=True)
    assert SamplerPlan.for_params(SamplingParams(temperature=0.0, min_tokens=4), VOCAB) == SamplerPlan(min_tokens=True)


@pytest.mark.parametrize("rows, plan", PLAN_CASES.values(), ids=PLAN_CASES.keys())
def test_the_plan_of_every_pass_samples_what_the_rows_own_plan_does(rows, plan):
    logits = logits_for(len(rows), seed=4)
    batch = sampling_batch(rows, len(rows), VOCAB)
    own, every = (jax.tree.map(np.asarray, jax.jit(sample, static_argnums=2)(logits, batch, p))
                  for p in (plan, EVERY_PASS))
    np.testing.assert_array_equal(every.tokens, own.tokens)
    np.testing.assert_allclose(every.logprobs, own.logprobs, rtol=1e-6)
    np.testing.assert_array_equal(every.accepted, own.accepted)
    if plan.top_logprobs:
        np.testing.assert_array_equal(every.top_ids, own.top_ids)


@pytest.mark.parametrize("rows, plan", PLAN_CASES.values(), ids=PLAN_CASES.keys())
def test_a_plan_the_host_decides_samples_what_the_device_decides_without_a_conditional(rows, plan):
    logits = logits_for(len(rows), seed=3)
    batch = sampling_batch(rows, len(rows), VOCAB)
    assert SamplerPlan.of(batch, np.arange(len(rows))) == plan
    planned = jax.jit(sample, static_argnums=2).lower(logits, batch, plan).compile()
    assert " conditional(" not in planned.as_text()
    with_plan, on_device = (jax.tree.map(np.asarray, out)
                            for out in (planned(logits, batch), sample_jit(logits, batch)))
    np.testing.assert_array_equal(with_plan.tokens, on_device.tokens)
    np.testing.assert_array_equal(with_plan.accepted, on_device.accepted)
    np.testing.assert_array_equal(with_plan.top_ids, on_device.top_ids)
    np.testing.assert_allclose(with_plan.logprobs, on_device.logprobs, rtol=1e-6)
    np.testing.assert_allclose(with_plan.top_logprobs, on_device.top_logprobs, rtol=1e-6)
