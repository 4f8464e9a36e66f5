"""Qwen2 and Llama 3 against HF transformers: a tiny random `Qwen2ForCausalLM` (q/k/v biases, tied embeddings, GQA;
tests/data/tiny_qwen2) and `LlamaForCausalLM` (llama3 RoPE scaling from an original context of 16, GQA, untied embeddings;
tests/data/tiny_llama3), written with what HF computes for them by tests/reference/make_family_golden.py, loaded
from their HF folders and as GGUFs, through the plain forward and the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from golden_checks import (LOGPROB_TOLERANCE, assert_engine_gives_golden, assert_forward_pass_gives_golden,
                           copy_with_tokenizer, home, load_as_gguf, log_softmax)  # noqa: F401 (home: a fixture)
from sluice.model.config import ModelConfig, RopeScaling
from sluice.model.generate import generate, sequence_logits
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel, load_model
from sluice.model.weights import ROPE_FREQS

DATA = Path(__file__).parent / "data"
# golden_checks' LOGPROB_TOLERANCE (1e-4) holds here as for the Qwen3: float32 both, the same bfloat16 weights, and
# HF's and Sluice's logprobs differ by 1.1e-5 (Qwen2) and 4.1e-6 (Llama 3) at most; the smallest top-1/top-2 gap on
# a greedy path (0.038, Llama 3's one_token) is 380 times it, and losing the biases or the scaling moves them by 3
# or more.


@dataclass(frozen=True)
class Family:
    """One golden folder, the config Sluice must read from it, and the GGUF architecture llama.cpp writes it as."""

    name: str
    config: ModelConfig
    gguf_arch: str

    @property
    def folder(self) -> Path:
        return DATA / self.name

    @cached_property
    def golden(self) -> dict:
        return json.loads((self.folder / "golden.json").read_text())


QWEN2 = Family("tiny_qwen2", ModelConfig(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True, max_position_embeddings=256,
    bos_token_id=1, eos_token_ids=(2,)), gguf_arch="qwen2")
LLAMA3 = Family("tiny_llama3", ModelConfig(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
    rope_theta=5e5, rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=2.0,
                                             original_max_position_embeddings=16),
    rms_norm_eps=1e-5, max_position_embeddings=128, bos_token_id=1, eos_token_ids=(2, 3)), gguf_arch="llama")
FAMILIES = {family.name: family for family in (QWEN2, LLAMA3)}
CASES = [(name, case) for name, family in FAMILIES.items() for case in family.golden["cases"]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory) -> Path:
    return copy_with_tokenizer(family.folder, tmp_path_factory.mktemp("family"), family.config.vocab_size)


@pytest.fixture(scope="module")
def loaded(home, folder) -> LoadedModel:
    return load_model(str(folder), dtype="float32")


def max_logprob_difference(model: Llama, case: dict) -> float:
    """The largest difference from HF's of any top-5 logprob on `case`'s greedy path under `model`."""
    prompt, expected = case["prompt_ids"], case["greedy_ids"]
    logprobs = log_softmax(sequence_logits(model, prompt + expected[:-1]))[len(prompt) - 1:]
    return max(abs(logprobs[step, token] - logprob)
               for step, top5 in enumerate(case["top5"]) for token, logprob in top5)


def test_the_config_json_transformers_5_writes_reads_as_its_model(family):
    """Qwen2's biases have no key (the model type implies them); Llama's llama3 scaling and rope_theta are inside
    rope_parameters, its head_dim (32) is not hidden / heads (16), and it has two EOS ids."""
    assert ModelConfig.from_hf(json.loads((family.folder / "config.json").read_text())) == family.config


@pytest.mark.parametrize("family, case", CASES, indirect=["family"],
                         ids=[f"{name}-{case['name']}" for name, case in CASES])
def test_the_forward_pass_gives_hfs_greedy_tokens_and_logprobs(loaded, case):
    assert_forward_pass_gives_golden(loaded.model, case)


def test_the_engine_prefilling_in_chunks_then_decoding_over_pages_gives_hfs_tokens_and_logprobs(family, loaded):
    """All cases in one batch: the 40-token prompt prefilled in chunks of 16, K/V in pages of 4 tokens."""
    assert_engine_gives_golden(loaded, family.golden)


def gguf_extras(family: Family) -> dict[str, np.ndarray]:
    """What llama.cpp's converter adds to the weights: a Llama 3's scaling as each frequency's divisor."""
    factors = family.golden.get("rope_freq_factors")
    return {} if factors is None else {ROPE_FREQS: np.asarray(factors, np.float32)}


def test_a_gguf_of_the_same_weights_gives_the_hf_folders_model(family, loaded, home, tmp_path):
    """The weights as llama.cpp's converter writes them (llama: Q/K rows permuted and the scaling as
    rope_freqs.weight, one EOS id; qwen2: biases as attn_q/k/v.bias), in float32."""
    extras = gguf_extras(family)
    gguf_model = load_as_gguf(family.folder, family.config, family.gguf_arch, tmp_path, extras)
    factors = extras.get(ROPE_FREQS)
    assert gguf_model.config == replace(
        family.config, rms_norm_eps=float(np.float32(family.config.rms_norm_eps)), eos_token_ids=(2,),
        rope_scaling=None,
        rope_freq_factors=None if factors is None else tuple(factors.astype(float)))
    case = family.golden["cases"][-1]
    assert generate(gguf_model.model, case["prompt_ids"], len(case["greedy_ids"])) == case["greedy_ids"]
    tokens = case["prompt_ids"] + case["greedy_ids"]
    np.testing.assert_allclose(sequence_logits(gguf_model.model, tokens), sequence_logits(loaded.model, tokens),
                               rtol=1e-5, atol=1e-5)


def test_without_its_rope_scaling_the_llama3_is_far_from_hfs(home, tmp_path):
    """The golden checks the scaling: read as plain RoPE, the model's logprobs move by 3.1 or more (1.1e-5 at most
    with it), from the first position on (llama3's scaling is the same at every position)."""
    folder = copy_with_tokenizer(LLAMA3.folder, tmp_path, LLAMA3.config.vocab_size)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (folder / "config.json").write_text(json.dumps(config))
    unscaled = load_model(str(folder), dtype="float32")
    assert unscaled.config == replace(LLAMA3.config, rope_scaling=None)
    assert max_logprob_difference(unscaled.model, LLAMA3.golden["cases"][-1]) > LOGPROB_TOLERANCE


@pytest.mark.parametrize("family", [QWEN2.name], indirect=True)
def test_without_its_qkv_biases_the_qwen2_is_far_from_hfs(family, home, folder):
    """The golden checks the biases: without them the model's logprobs move by 17 or more."""
    unbiased = load_model(str(folder), dtype="float32").model
    unbiased.bqkv.set_value(jnp.zeros_like(unbiased.bqkv[...]))
    assert max_logprob_difference(unbiased, QWEN2.golden["cases"][-1]) > LOGPROB_TOLERANCE
