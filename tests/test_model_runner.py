"""The model runner on the tiny random model: the shapes it pads a step to, and what a step's outputs say about
each sequence whatever kind of step ran (single, multi-step, drafts checked alone or inside a multi-step call)."""

from __future__ import annotations

import math
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sluice.batching import device_step
from sluice.batching.engine import Engine
from sluice.batching.model_runner import PREFILL_PIECE, ModelRunner
from sluice.batching.sampling_params import SamplingParams
from sluice.batching.scheduler import ScheduledChunk
from sluice.model.llama import Llama
from sequences import make_sequence
from test_speculative import CONFIG, GREEDY, PROMPTS, TINY, free_verification, tiny  # noqa: F401 - `tiny` is a fixture


def most_pieces(num_tokens: int, max_num_seqs: int) -> list[int]:
    """Chunk lengths of at most `num_tokens` tokens in all that split into the most prefill pieces: as many chunks as
    may run, each a piece's worth of tokens past whole pieces (decodes, and partial prefills of 17, 33, ...)."""
    num_chunks = min(max_num_seqs, num_tokens)
    whole = np.full(num_chunks, (num_tokens - num_chunks) // PREFILL_PIECE // num_chunks)
    whole[:(num_tokens - num_chunks) // PREFILL_PIECE % num_chunks] += 1
    return (1 + PREFILL_PIECE * whole).tolist()


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(8, 8), (64, 1000), (1024, 3000)])
def test_a_mixed_bucket_has_the_attention_rows_of_any_chunks_it_takes(max_num_seqs, max_num_batched_tokens):
    """The most prefill pieces a step of each token bucket may hold, last buckets of no quarter octave included."""
    runner = ModelRunner(Llama(TINY, rngs=nnx.Rngs(0)), num_pages=8, page_size=4, max_model_len=256,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    for num_tokens in runner.token_buckets:
        lengths = most_pieces(num_tokens, max_num_seqs)
        chunks = [ScheduledChunk(make_sequence(i, [5] * length, SamplingParams()), 0, length)
                  for i, length in enumerate(lengths)]
        for slot, chunk in enumerate(chunks):
            chunk.seq.slot = slot
        bucket = runner.bucket_for(chunks, scores=True)  # mixed-shaped even when every chunk is one token
        inputs, _ = runner._pad(chunks, bucket, None)
        assert bucket.num_tokens == num_tokens
        assert (inputs.kv_lens > 0).sum() == sum(-(-length // PREFILL_PIECE) for length in lengths)
        assert inputs.cu_q_lens[-1] == sum(lengths) <= num_tokens


def logits_not_finite_at_the_seeds_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's sampler sees NaN logits for a row sampling the output index its seed names (a greedy row
    never reads its seed otherwise), as a model whose numbers overflow at one token would give."""
    sample = device_step.sample

    def poisoned(logits, batch, plan=None):
        at_seed = batch.step == batch.seed.astype(jnp.int32)
        return sample(jnp.where(at_seed[:, None], jnp.nan, logits), batch, plan)

    monkeypatch.setattr(device_step, "sample", poisoned)


STEP_KINDS = {"single-steps": (1, None), "multi-step-calls": (4, None), "drafts-in-single-steps": (1, "ngram"),
              "drafts-in-multi-step-calls": (4, "ngram")}


@pytest.mark.parametrize("num_decode_steps, speculative", STEP_KINDS.values(), ids=STEP_KINDS.keys())
def test_a_token_whose_logits_are_not_finite_fails_its_request_wherever_it_was_sampled(tiny, monkeypatch,
                                                                                         num_decode_steps, speculative):
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
