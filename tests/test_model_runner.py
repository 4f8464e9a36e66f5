"""The model runner on the tiny random model: what a step's outputs say about each sequence whatever kind of step
ran (single, multi-step, drafts checked alone or inside a multi-step call)."""

from __future__ import annotations

import math
from dataclasses import replace

import jax.numpy as jnp
import pytest

from sluice.batching import device_step
from sluice.batching.engine import Engine
from test_speculative import CONFIG, GREEDY, PROMPTS, free_verification, tiny  # noqa: F401 - `tiny` is a fixture


def logits_not_finite_at_the_seeds_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's sampler sees NaN logits for a row sampling the output index its seed names (a greedy row
    never reads its seed otherwise), as a model whose numbers overflow at one token would give."""
    sample = device_step.sample

    def poisoned(logits, batch, plan=None):
        at_seed = batch.step == batch.seed.astype(jnp.int32)
        return sample(jnp.where(at_seed[:, None], jnp.nan, logits), batch, plan)

    monkeypatch.setattr(device_step, "sample", poisoned)


@pytest.mark.parametrize("num_decode_steps, speculative", [(1, None), (4, None), (1, "ngram"), (4, "ngram")],
                         ids=["single-steps", "multi-step-calls", "drafts-in-single-steps", "drafts-in-multi-step-calls"])
def test_a_token_whose_logits_are_not_finite_fails_its_request_wherever_it_was_sampled(tiny, monkeypatch,
                                                                                         num_decode_steps,
                                                                                         speculative):
    """Inside a multi-step call that checks drafts, a token may be sampled at a draft's row (or right after the
    accepted drafts), not only at its sequence's first row: its logits are checked there too."""
    logits_not_finite_at_the_seeds_index(monkeypatch)
    engine = Engine(tiny, replace(CONFIG, speculative=speculative, num_decode_steps=num_decode_steps),
                    progress=False)
    if speculative:
        free_verification(engine)
    seeds = range(4, 12)
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(seeds))],
                           [replace(GREEDY, max_tokens=20, seed=seed) for seed in seeds])
    for seed, out in zip(seeds, outs):
        assert out[0].finish_reason == "error"
        assert len(out[0].token_ids) <= seed and all(math.isfinite(lp.logprob) for lp in out[0].logprobs)
    assert engine.stats.kv_pages_used == 0
