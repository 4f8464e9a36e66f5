"""Granite 3.x against HF transformers: a tiny random `GraniteForCausalLM` (tests/data/tiny_granite, written with what
HF computes for it by tests/reference/make_granite_golden.py) loaded from its HF folder and as a granite GGUF, through
the plain forward and the engine; and each of Granite's four scalars shown to matter."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from golden_checks import (LOGPROB_TOLERANCE, assert_engine_gives_golden, assert_forward_pass_gives_golden,
                           copy_with_tokenizer, home, load_as_gguf, log_softmax)  # noqa: F401 (home: a fixture)
from sluice.model.config import GRANITE_SCALARS, ModelConfig, RopeScaling
from sluice.model.generate import generate, sequence_logits
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel, load_model

FOLDER = Path(__file__).parent / "data" / "tiny_granite"
GOLDEN = json.loads((FOLDER / "golden.json").read_text())
CASES = GOLDEN["cases"]
PLAIN_LLAMA = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in GRANITE_SCALARS}
"""Each Granite scalar's default, at which it changes nothing."""
# golden_checks' LOGPROB_TOLERANCE (1e-4) holds: HF's and Sluice's logprobs differ by 1e-6 at most; the smallest
# top-1/top-2 gap on a greedy path (2.3) is far above it, and serving the model without any one of its scalars
# moves its prompt logprobs by 0.03 or more (without its softmax scale; 0.17 or more without another). Its tied
# embeddings draw each greedy path back to the last prompt token, repeated; the prompt logprobs and each step's top 5
# still check the attention.

CONFIG = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, rope_theta=1e7, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,), embedding_multiplier=12.0,
                     residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The golden folder with a tokenizer added (the loader needs one; the golden prompts are token ids)."""
    return copy_with_tokenizer(FOLDER, tmp_path_factory.mktemp("granite"), CONFIG.vocab_size)


@pytest.fixture(scope="module")
def granite(home, folder) -> LoadedModel:
    return load_model(str(folder), dtype="float32")


def without(model: Llama, scalar: str) -> Llama:
    """A copy of `model` served as a plain Llama in `scalar` (ModelConfig's default for it)."""
    plain = nnx.clone(model)
    plain.config = replace(model.config, **{scalar: PLAIN_LLAMA[scalar]})
    return plain


def prompt_logprob_error(model: Llama, case: dict) -> float:
    """The largest difference from HF's of any prompt token's logprob (after the tokens before it) under `model`."""
    prompt = case["prompt_ids"]
    logprobs = log_softmax(sequence_logits(model, prompt))[np.arange(len(prompt) - 1), prompt[1:]]
    return float(np.max(np.abs(logprobs - case["prompt_logprobs"])))


def test_a_granite_config_json_written_by_transformers_5_reads_as_its_model():
    """The four scalars are its own keys; head_dim has none (hidden / heads), rope_theta is in rope_parameters."""
    assert ModelConfig.from_hf(json.loads((FOLDER / "config.json").read_text())) == CONFIG


def test_the_defaults_of_a_granite_config_json_are_transformers_own():
    """GraniteConfig's default attention_multiplier is 1, not head_dim**-0.5; its other scalars' are 1 too, and its
    eps 1e-6."""
    written = json.loads((FOLDER / "config.json").read_text())
    config = ModelConfig.from_hf({k: v for k, v in written.items() if k not in (*GRANITE_SCALARS, "rms_norm_eps")})
    assert [getattr(config, scalar) for scalar in GRANITE_SCALARS] == [1.0, 1.0, 1.0, 1.0]
    assert (config.softmax_scale, config.rms_norm_eps) == (1.0, 1e-6)


@pytest.mark.parametrize("scalar", list(GRANITE_SCALARS))
def test_a_granite_scalar_that_is_no_positive_number_is_refused(scalar):
    written = json.loads((FOLDER / "config.json").read_text())
    for bad in (0, -1.0, "8", True):
        with pytest.raises(ValueError, match=f"config.json's {scalar} must be a positive number"):
            ModelConfig.from_hf({**written, scalar: bad})


def test_the_softmax_scale_is_head_dim_to_the_minus_half_without_an_attention_multiplier():
    assert ModelConfig.tiny().softmax_scale == 16**-0.5
    assert CONFIG.softmax_scale == 0.0625


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_forward_pass_gives_hfs_greedy_tokens_and_logprobs(granite, case):
    assert_forward_pass_gives_golden(granite.model, case)


def test_the_engine_prefilling_in_chunks_then_decoding_over_pages_gives_hfs_tokens_and_logprobs(granite):
    """All cases in one batch: the 40-token prompt prefilled in chunks of 16, K/V in pages of 4 tokens."""
    assert_engine_gives_golden(granite, GOLDEN)


def test_speculation_verifies_drafts_against_the_scaled_logits(granite):
    """The greedy paths repeat a prompt token, so n-gram drafts are proposed and accepted: the verify step's logits
    must be scaled as the decode step's."""
    assert_engine_gives_golden(granite, GOLDEN, speculative="ngram", num_speculative_tokens=3)


def test_a_granite_gguf_gives_the_hf_folders_model(granite, home, tmp_path):
    """The same weights as llama.cpp's converter writes them (granite: Q/K rows permuted as for llama, the scalars
    as embedding_scale, residual_scale, attention.scale and logit_scale), in float32."""
    loaded = load_as_gguf(FOLDER, CONFIG, "granite", tmp_path)
    float32 = lambda value: float(np.float32(value))  # GGUF keys are float32
    assert loaded.config == replace(CONFIG, rms_norm_eps=float32(CONFIG.rms_norm_eps),
                                    residual_multiplier=float32(CONFIG.residual_multiplier))
    case = CASES[-1]
    assert generate(loaded.model, case["prompt_ids"], len(case["greedy_ids"])) == case["greedy_ids"]
    tokens = case["prompt_ids"] + case["greedy_ids"]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens), sequence_logits(granite.model, tokens),
                               rtol=1e-5, atol=1e-5)


GRANITE_GGUF_FIELDS = {"general.architecture": "granite", "granite.block_count": 2, "granite.embedding_length": 64,
                       "granite.feed_forward_length": 128, "granite.attention.head_count": 4, "granite.vocab_size": 320}


@pytest.mark.parametrize("unset", [None, 0.0], ids=["absent", "zero"])
def test_a_granite_gguf_without_an_attention_scale_scales_by_head_dim_to_the_minus_half(unset):
    """As llama.cpp's granite graph does (an attention.scale of 0 or none; llama.cpp's own saver writes 0 for a scalar
    not set, which was refused as not positive); its other scalars default to 1."""
    unset_keys = {} if unset is None else {f"granite.{key}": unset
                                           for key in ("embedding_scale", "residual_scale", "attention.scale")}
    config = ModelConfig.from_gguf_fields({**GRANITE_GGUF_FIELDS, **unset_keys, "granite.logit_scale": 8.0},
                                          tied_embeddings=True)
    assert (config.softmax_scale, config.embedding_multiplier, config.residual_multiplier,
            config.logits_scaling) == (16**-0.5, 1.0, 1.0, 8.0)


def test_a_granite_gguf_without_a_logit_scale_is_refused_as_llama_cpp_refuses_it():
    """Served with none, the logits were 8-16x too sharp."""
    with pytest.raises(ValueError, match="^the GGUF metadata lacks granite.logit_scale, which llama.cpp requires of a "
                                         "Granite$"):
        ModelConfig.from_gguf_fields(GRANITE_GGUF_FIELDS, tied_embeddings=True)


@pytest.mark.parametrize("scalar", list(GRANITE_SCALARS))
def test_served_without_any_one_scalar_the_granite_is_far_from_hfs(granite, scalar):
    """The golden checks each scalar: without it, the prompt logprobs move by 0.03 or more (1e-6 at most with all)."""
    case = CASES[-1]
    assert prompt_logprob_error(granite.model, case) < LOGPROB_TOLERANCE
    assert prompt_logprob_error(without(granite.model, scalar), case) > 100 * LOGPROB_TOLERANCE


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_logits_are_divided_by_logits_scaling_whichever_the_lm_head(tied):
    model = Llama(ModelConfig.tiny(tie_word_embeddings=tied, logits_scaling=4.0), rngs=nnx.Rngs(0))
    hidden = jax.random.normal(jax.random.key(1), (3, model.config.hidden_size))
    np.testing.assert_allclose(model.logits(hidden), without(model, "logits_scaling").logits(hidden) / 4.0,
                               rtol=1e-6)


YARN = RopeScaling(4.0, original_max_position_embeddings=64, kind="yarn", beta_fast=32.0, beta_slow=1.0,
                   attention_factor=1.2)


@pytest.mark.parametrize("scalar", ["embedding_multiplier", "residual_multiplier", "logits_scaling", "rope_scaling"])
def test_a_scalar_of_1_adds_nothing_to_the_program(scalar):
    """A Llama's compiled programs stay what they were: a scalar of 1 is skipped, not multiplied by (YaRN's
    attention factor, which scales cos and sin, too)."""
    def multiplications(config: ModelConfig) -> int:
        model = Llama(config, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def logits(state, token_ids):
            model = nnx.merge(graphdef, state)
            hidden, _ = model(token_ids, jnp.arange(4), (None, None), lambda layer, q, k, v, kv: (q, kv))
            return model.logits(hidden)

        return str(jax.make_jaxpr(logits)(state, jnp.arange(4))).count(" mul ")

    assert multiplications(ModelConfig.tiny()) < multiplications(
        ModelConfig.tiny(**{scalar: YARN if scalar == "rope_scaling" else 2.0}))
