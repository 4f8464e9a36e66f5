"""RoPE scaling of type "yarn" and "linear" against HF transformers: tiny random models (tests/data/tiny_yarn, a Qwen2
with YaRN; tests/data/tiny_linear_rope, a Llama scaled linearly; written with what HF computes for them by
tests/reference/make_rope_scaling_golden.py) loaded from their HF folders through the plain forward and the engine,
past their original context; HF's frequencies and attention factor for each YaRN key; the context served, as vLLM
derives it; the same scalings read from GGUF metadata; and the scalings Sluice still refuses."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from golden_checks import (LOGPROB_TOLERANCE, assert_engine_gives_golden, assert_forward_pass_gives_golden,
                           copy_with_tokenizer, home, load_as_gguf, log_softmax)  # noqa: F401 (home: a fixture)
from sluice.model import checkpoint
from sluice.model.config import ModelConfig, RopeScaling
from sluice.model.generate import sequence_logits
from sluice.model.loader import LoadedModel, load_model

DATA = Path(__file__).parent / "data"
FOLDERS = {"yarn": DATA / "tiny_yarn", "linear": DATA / "tiny_linear_rope"}
GOLDENS = {name: json.loads((folder / "golden.json").read_text()) for name, folder in FOLDERS.items()}
CASES = [(name, case) for name, golden in GOLDENS.items() for case in golden["cases"]]
ROPE_CASES = json.loads((FOLDERS["yarn"] / "rope_cases.json").read_text())["cases"]
# golden_checks' LOGPROB_TOLERANCE (1e-4) holds: HF's own logprobs move by up to 1.3e-5 when its last position is
# decoded over its KV cache instead (`cached_last_step_change`), and the smallest top-1/top-2 gap on a greedy path
# (0.0058) is 58 times it.

# transformers' YaRN attention factor for a factor of 4 (`get_mscale`): cos and sin scaled by it, q.k by its square.
YARN_ATTENTION = 0.1 * math.log(4.0) + 1.0
SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_ids=(2,))
EXPECTED = {
    "yarn": ModelConfig(**SIZES, attention_bias=True, max_position_embeddings=128, rope_scaling=RopeScaling(
        4.0, original_max_position_embeddings=32, kind="yarn", beta_fast=32.0, beta_slow=1.0,
        attention_factor=YARN_ATTENTION)),
    "linear": ModelConfig(**SIZES, max_position_embeddings=128, rope_scaling=RopeScaling(2.0, kind="linear")),
}
"""What each folder's config.json reads as: 4 x the original 32 positions, and 2 x the model's 64."""
GGUF_ARCH = {"yarn": "qwen2", "linear": "llama"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The golden folders with a tokenizer added (the loader needs one; the golden prompts are token ids)."""
    return {name: copy_with_tokenizer(source, tmp_path_factory.mktemp(name), EXPECTED[name].vocab_size)
            for name, source in FOLDERS.items()}


@pytest.fixture(scope="module")
def models(home, folders) -> dict[str, LoadedModel]:
    return {name: load_model(str(folder), dtype="float32") for name, folder in folders.items()}


def config_json(name: str) -> dict[str, Any]:
    return json.loads((FOLDERS[name] / "config.json").read_text())


def gguf_fields(config: ModelConfig, arch: str, **rope: Any) -> dict[str, Any]:
    """The GGUF metadata llama.cpp's converter writes for `config` as `arch` (its context as given), with `rope`:
    `rope.*` keys without the architecture, dots written as "__" (`scaling__type="yarn"`)."""
    fields = {"general.architecture": arch, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    keys = {"block_count": config.num_layers, "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
            "attention.head_count": config.num_heads, "attention.head_count_kv": config.num_kv_heads,
            "rope.freq_base": config.rope_theta, "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
            "vocab_size": config.vocab_size,
            **{f"rope.{key.replace('__', '.')}": value for key, value in rope.items()}}
    return fields | {f"{arch}.{key}": value for key, value in keys.items()}


def yarn_gguf_fields(config: ModelConfig, **rope: Any) -> dict[str, Any]:
    """`config`'s metadata as llama.cpp's converter writes a qwen2 with a YaRN of factor 4 over 32 positions from
    config.json's 128 positions, with `rope` keys added."""
    return gguf_fields(replace(config, max_position_embeddings=128), "qwen2", scaling__type="yarn",
                       scaling__factor=4.0, scaling__original_context_length=32, **rope)


@pytest.mark.parametrize("name", FOLDERS)
def test_a_config_json_written_by_transformers_5_reads_as_its_scaling_and_the_context_it_serves(name):
    assert ModelConfig.from_hf(config_json(name)) == EXPECTED[name]


@pytest.mark.parametrize(("name", "case"), CASES, ids=[f"{name}-{case['name']}" for name, case in CASES])
def test_the_forward_pass_gives_hfs_greedy_tokens_and_logprobs_past_the_original_context(models, name, case):
    assert_forward_pass_gives_golden(models[name].model, case)


@pytest.mark.parametrize("name", FOLDERS)
def test_the_engine_prefilling_in_chunks_then_decoding_over_pages_gives_hfs_tokens_and_logprobs(models, name):
    """All cases in one batch, up to 128 positions (past the 32 or 64 of the unscaled model): the 100-token prompt
    prefilled in chunks of 16, K/V in pages of 4 tokens."""
    assert_engine_gives_golden(models[name], GOLDENS[name])


@pytest.mark.parametrize("name", FOLDERS)
def test_served_without_its_scaling_the_model_is_another_than_hfs(home, folders, name):
    """What the golden tests tell apart: unscaled frequencies (and no attention factor) move the logprobs of the
    100-token case by far more than their tolerance."""
    model = load_model(str(folders[name]), dtype="float32").model
    model.config = replace(model.config, rope_scaling=None)
    case = GOLDENS[name]["cases"][-1]
    logprobs = log_softmax(sequence_logits(model, case["prompt_ids"]))
    difference = logprobs[np.arange(len(case["prompt_ids"]) - 1), case["prompt_ids"][1:]] - case["prompt_logprobs"]
    assert np.max(np.abs(difference)) > 100 * LOGPROB_TOLERANCE


def test_a_conversion_restored_keeps_its_scaling(models, home, folders):
    """The second load restores the conversion the first one saved, its config from JSON."""
    assert load_model(str(folders["yarn"]), dtype="float32").config == models["yarn"].config == EXPECTED["yarn"]


def test_a_conversion_saved_before_scalings_had_a_kind_restores_llama_3s(tmp_path):
    """A version-9 conversion's config.json holds Llama 3's four fields only."""
    llama3 = replace(EXPECTED["linear"], rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), max_position_embeddings=64)
    saved = asdict(llama3)
    saved["rope_scaling"] = {key: saved["rope_scaling"][key] for key in ("factor", "low_freq_factor",
                                                                         "high_freq_factor",
                                                                         "original_max_position_embeddings")}
    (tmp_path / checkpoint.CONFIG_FILE).write_text(json.dumps(saved))
    assert checkpoint.load_config(tmp_path) == llama3


@pytest.mark.parametrize("case", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_each_rope_setting_gives_hfs_frequencies_and_attention_factor(case):
    """Beta fast and slow, an attention factor given or made of mscale and mscale_all_dim (not of mscale alone),
    the correction range untruncated, a factor of 1, no original context (the model's), one outside the scaling (as
    Phi-3 writes it, which transformers prefers), transformers 4's rope_scaling, linear."""
    config = ModelConfig.from_hf(case["config"])
    np.testing.assert_allclose(config.rope_inv_freq(), case["inv_freq"], rtol=1e-6)
    assert config.rope_attention_factor == pytest.approx(case["attention_factor"], rel=1e-6)


def test_a_yarn_context_is_the_original_context_times_the_factor_as_vllm_serves_it():
    """Qwen3's config.json with the YaRN its model card gives (max_position_embeddings 40960): 4 x 32768."""
    qwen3 = {**config_json("yarn"), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
             "max_position_embeddings": 40960,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    del qwen3["rope_parameters"]
    assert ModelConfig.from_hf(qwen3).max_position_embeddings == 131072


def test_a_yarn_context_without_an_original_one_is_the_models_times_the_factor():
    written = config_json("yarn")
    written["rope_parameters"] = {"rope_type": "yarn", "factor": 2.5, "rope_theta": 10000.0}
    assert ModelConfig.from_hf(written).max_position_embeddings == 320


def test_a_linear_context_is_the_models_context_times_the_factor():
    written = config_json("linear")
    written["rope_parameters"] = {**written["rope_parameters"], "factor": 2.5}
    assert ModelConfig.from_hf(written).max_position_embeddings == 160


def test_a_llama_3_context_is_the_models_own():
    """vLLM leaves Llama 3's context unscaled (its max_position_embeddings is already the scaled one)."""
    written = config_json("linear")
    written["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                  "rope_theta": 10000.0}
    config = ModelConfig.from_hf(written)
    assert (config.max_position_embeddings, config.rope_attention_factor) == (64, 1.0)


def test_a_sliding_window_still_caps_a_scaled_context():
    """Sluice's attention is full causal: a window shorter than the scaled context bounds it."""
    written = {**config_json("yarn"), "use_sliding_window": True, "sliding_window": 96}
    assert ModelConfig.from_hf(written).max_position_embeddings == 96


@pytest.mark.parametrize(("name", "rope"), [
    ("yarn", dict(scaling__type="yarn", scaling__factor=4.0, scaling__original_context_length=32)),
    ("linear", dict(scaling__type="linear", scaling__factor=2.0)),
    ("linear", dict(scaling__factor=2.0)),  # llama.cpp scales linearly where no type is named
    ("linear", dict(scale_linear=2.0)),  # the older key
], ids=["yarn", "linear", "linear-by-default", "scale_linear"])
def test_gguf_metadata_gives_the_config_jsons_scaling(name, rope):
    """llama.cpp's converter writes the model's own context (max_position_embeddings) as context_length."""
    from_json = ModelConfig.from_hf(config_json(name))
    unscaled = config_json(name)["max_position_embeddings"]
    from_gguf = ModelConfig.from_gguf_fields(gguf_fields(replace(from_json, max_position_embeddings=unscaled),
                                                         GGUF_ARCH[name], **rope), tied_embeddings=False)
    assert from_gguf == from_json
    np.testing.assert_array_equal(from_gguf.rope_inv_freq(), from_json.rope_inv_freq())


@pytest.mark.parametrize(("rope", "case"), [
    (dict(scaling__yarn_beta_fast=4.0, scaling__yarn_beta_slow=2.0), "yarn_betas"),
    (dict(scaling__yarn_attn_factor=0.9), "yarn_attention_factor"),
])
def test_the_yarn_keys_llama_cpps_converter_copies_from_config_json_mean_what_they_meant_there(rope, case):
    """yarn_beta_fast, yarn_beta_slow and yarn_attn_factor are config.json's beta_fast, beta_slow and
    attention_factor, as the converter copies them (llama.cpp's llama and qwen graphs leave them unread)."""
    expected = ModelConfig.from_hf(ROPE_CASES[case]["config"])
    assert ModelConfig.from_gguf_fields(yarn_gguf_fields(expected, **rope), tied_embeddings=False) == expected


def test_a_gguf_attn_factor_scales_yarns_own_as_llama_cpp_applies_it():
    config = ModelConfig.from_gguf_fields(yarn_gguf_fields(EXPECTED["yarn"], scaling__attn_factor=0.5),
                                          tied_embeddings=False)
    assert config.rope_attention_factor == pytest.approx(0.5 * YARN_ATTENTION)


def test_a_yarn_gguf_of_the_hf_folders_weights_gives_its_logits(models, home, tmp_path, monkeypatch):
    """As llama.cpp's converter writes a qwen2 with YaRN, in float32, loaded through the loader."""
    class Writer(gguf.GGUFWriter):
        def write_header_to_file(self, *args, **kwargs) -> None:
            self.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            self.add_rope_scaling_factor(4.0)
            self.add_rope_scaling_orig_ctx_len(32)
            super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    loaded = load_as_gguf(FOLDERS["yarn"], EXPECTED["yarn"], "qwen2", tmp_path)
    assert loaded.config == replace(EXPECTED["yarn"], rms_norm_eps=float(np.float32(1e-6)))  # a float32 key
    tokens = CASES[2][1]["prompt_ids"]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens), sequence_logits(models["yarn"].model, tokens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("scaling", "words"), [
    ({"rope_type": "dynamic", "factor": 2.0}, "config.json asks for RoPE scaling of type 'dynamic' (factor 2.0), "
                                              "which Sluice does not implement"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
     "config.json asks for RoPE scaling of type 'longrope', which Sluice does not implement"),
    ({"rope_type": "a-future-one", "factor": 1.0}, "config.json asks for RoPE scaling of type 'a-future-one' "
                                                   "(factor 1.0), which Sluice does not implement"),
    ({"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 0.5},
     "config.json's rope_parameters of type 'yarn' has extrapolation_factor, which Sluice does not implement"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0},
     "config.json's rope_parameters of type 'linear' has low_freq_factor, which Sluice does not implement"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32}, "config.json's rope_parameters of type 'yarn' "
                                                                     "lacks factor"),
    ({"rope_type": "linear", "factor": "2"}, "config.json's rope_parameters' factor must be a positive number, "
                                             "got '2'"),
], ids=["dynamic", "longrope", "unknown", "yarn-unknown-key", "linear-unknown-key", "yarn-no-factor",
        "linear-factor-not-a-number"])
def test_a_scaling_sluice_does_not_implement_in_a_config_json_is_refused_in_one_line(scaling, words):
    written = {**config_json("yarn"), "rope_parameters": {"rope_theta": 10000.0, **scaling}}
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_hf(written)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value)


def test_a_rope_scaling_added_beside_transformers_5s_rope_parameters_is_refused_not_ignored():
    """As a model card says to add YaRN, to a config.json transformers 5 wrote: it was served unscaled
    (transformers itself takes the scaling and loses rope_parameters' rope_theta)."""
    written = {**config_json("linear"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32}}
    with pytest.raises(ValueError, match=r"^config.json has both rope_parameters and rope_scaling: write the scaling "
                                         r"into rope_parameters$"):
        ModelConfig.from_hf(written)


@pytest.mark.parametrize(("rope", "words"), [
    (dict(scaling__type="longrope"), "the GGUF metadata asks for RoPE scaling of type 'longrope'"),
    (dict(scaling__type="a-future-one"), "the GGUF metadata asks for RoPE scaling of type 'a-future-one'"),
    (dict(scaling__type="yarn", scaling__factor=4.0, scaling__yarn_log_multiplier=0.1),
     "the GGUF metadata's qwen2.rope.scaling.yarn_log_multiplier is 0.1, which Sluice does not implement with RoPE "
     "scaling of type 'yarn'"),
    (dict(scaling__type="yarn", scaling__factor=4.0, scaling__yarn_ext_factor=0.5),
     "the GGUF metadata's qwen2.rope.scaling.yarn_ext_factor is 0.5, which Sluice does not implement with RoPE "
     "scaling of type 'yarn'"),
    (dict(scaling__type="linear", scaling__factor=2.0, scaling__attn_factor=0.5),
     "the GGUF metadata's qwen2.rope.scaling.attn_factor is 0.5, which Sluice does not implement with RoPE "
     "scaling of type 'linear'"),
], ids=["longrope", "unknown", "yarn_log_multiplier", "yarn_ext_factor", "attn_factor-without-yarn"])
def test_a_scaling_sluice_does_not_implement_in_gguf_metadata_is_refused_in_one_line(rope, words):
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_gguf_fields(gguf_fields(EXPECTED["yarn"], "qwen2", **rope), tied_embeddings=False)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value)


def test_rope_freqs_with_a_yarn_scaling_are_refused():
    """llama.cpp divides by rope_freqs.weight before it scales; Sluice takes them as the whole scaling (Llama 3's)."""
    with pytest.raises(ValueError, match=r"^the GGUF file's rope_freqs.weight with RoPE scaling of type 'yarn', "
                                         r"which Sluice does not implement$"):
        ModelConfig.from_gguf_fields(yarn_gguf_fields(EXPECTED["yarn"]), tied_embeddings=False,
                                     rope_freq_factors=(1.0,) * 8)


def test_a_positional_rope_scaling_is_llama_3s_and_scales_no_attention():
    """How configs built it before scalings had a kind (bench/engine_check.py, the tests of Llama 3.1)."""
    config = ModelConfig.tiny(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    assert (config.rope_scaling.kind, config.rope_attention_factor) == ("llama3", 1.0)
