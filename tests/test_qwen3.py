"""Qwen3 against HF transformers: a tiny random `Qwen3ForCausalLM` (tests/data/tiny_qwen3, written with what HF
computes for it by tests/reference/make_qwen3_golden.py) loaded from its HF folder and as a qwen3 GGUF, through the
plain forward and the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from golden_checks import (assert_engine_gives_golden, assert_forward_pass_gives_golden, copy_with_tokenizer,
                           home, load_as_gguf, log_softmax)  # noqa: F401 (home: a fixture)
from sluice.model.config import ModelConfig
from sluice.model.generate import sequence_logits
from sluice.model.loader import LoadedModel, load_model

FOLDER = Path(__file__).parent / "data" / "tiny_qwen3"
GOLDEN = json.loads((FOLDER / "golden.json").read_text())
CASES = GOLDEN["cases"]
# golden_checks' LOGPROB_TOLERANCE (1e-4) holds: HF's and Sluice's logprobs differ by 1.1e-5 at most; the smallest
# top-1/top-2 gap on a greedy path (0.011) is 100 times it.

CONFIG = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, qk_norm=True,
                     max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The golden folder with a tokenizer added (the loader needs one; the golden prompts are token ids)."""
    return copy_with_tokenizer(FOLDER, tmp_path_factory.mktemp("qwen3"), CONFIG.vocab_size)


@pytest.fixture(scope="module")
def qwen3(home, folder) -> LoadedModel:
    return load_model(str(folder), dtype="float32")


def test_a_qwen3_config_json_written_by_transformers_5_reads_as_its_model():
    """Its head_dim is not hidden / heads, its q/k norms have no key (the model type implies them), and
    transformers 5 writes rope_theta inside rope_parameters (read as 10000 it was another model)."""
    assert ModelConfig.from_hf(json.loads((FOLDER / "config.json").read_text())) == CONFIG


def test_the_defaults_of_a_qwen3_config_json_are_transformers_own():
    """head_dim 128 (not hidden / heads) and eps 1e-6 where the file leaves them out, as Qwen3Config has them."""
    written = json.loads((FOLDER / "config.json").read_text())
    config = ModelConfig.from_hf({k: v for k, v in written.items() if k not in ("head_dim", "rms_norm_eps")})
    assert (config.head_dim, config.rms_norm_eps) == (128, 1e-6)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_the_forward_pass_gives_hfs_greedy_tokens_and_logprobs(qwen3, case):
    assert_forward_pass_gives_golden(qwen3.model, case)


def test_the_engine_prefilling_in_chunks_then_decoding_over_pages_gives_hfs_tokens_and_logprobs(qwen3):
    """All cases in one batch: the 40-token prompt prefilled in chunks of 16, K/V in pages of 4 tokens."""
    assert_engine_gives_golden(qwen3, GOLDEN)


def test_a_qwen3_gguf_gives_the_hf_folders_model(qwen3, home, tmp_path):
    """The same weights as llama.cpp's converter writes them (qwen3: Q/K rows not permuted, q/k norms as
    attn_q_norm / attn_k_norm, head_dim as key_length), in float32."""
    loaded = load_as_gguf(FOLDER, CONFIG, "qwen3", tmp_path)
    assert loaded.config == replace(CONFIG, rms_norm_eps=float(np.float32(CONFIG.rms_norm_eps)))  # a float32 key
    tokens = CASES[-1]["prompt_ids"] + CASES[-1]["greedy_ids"]
    np.testing.assert_allclose(sequence_logits(loaded.model, tokens), sequence_logits(qwen3.model, tokens),
                               rtol=1e-5, atol=1e-5)


def test_layers_stored_one_array_each_give_the_stacks_logits(qwen3, home, folder):
    """The layers unrolled (as on a GPU) read each layer's own q/k norms."""
    unstacked = load_model(str(folder), dtype="float32").model
    unstacked.unstack_layers()
    assert isinstance(unstacked.q_norm.get_value(), tuple)
    tokens = CASES[-1]["prompt_ids"]
    np.testing.assert_allclose(sequence_logits(unstacked, tokens), sequence_logits(qwen3.model, tokens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_keep_the_qk_norms_float(qwen3, home, folder, quantization):
    quantized = load_model(str(folder), dtype="float32", quantization=quantization).model
    assert quantized.wqkv[...].dtype != jnp.float32
    for name in ("q_norm", "k_norm"):
        np.testing.assert_array_equal(getattr(quantized, name)[...], getattr(qwen3.model, name)[...])


def test_int8_weights_stay_near_the_float_model(qwen3, home, folder):
    """On this model, whose logits spread over tens, int8 moves a logprob by 0.19 on average (the CPU kernels
    quantize the activations too); q/k norm weights of ones in place of its own move them by 2.9."""
    quantized = load_model(str(folder), dtype="float32", quantization="int8").model
    tokens = CASES[-1]["prompt_ids"] + CASES[-1]["greedy_ids"]
    difference = log_softmax(sequence_logits(quantized, tokens)) - log_softmax(sequence_logits(qwen3.model, tokens))
    assert np.mean(np.abs(difference)) < 0.5


TENSOR_PARALLEL = """
import json, sys
from functools import partial
import numpy as np
from sluice.model.generate import sequence_logits
from sluice.model.loader import load_model
from sluice.sharding.mesh import make_mesh
from sluice.sharding.rules import param_sharding
model = load_model(sys.argv[1], dtype="float32", sharding_rule=partial(param_sharding, make_mesh(2))).model
print(json.dumps({"wqkv_devices": len(model.wqkv[...].sharding.device_set),
                  "norms_replicated": [norm[...].sharding.is_fully_replicated for norm in (model.q_norm, model.k_norm)],
                  "logits": np.asarray(sequence_logits(model, json.loads(sys.argv[2]))).tolist()}))
"""


def test_two_way_tensor_parallelism_splits_the_heads_and_replicates_the_qk_norms(qwen3, home, folder):
    """On 2 simulated CPU devices, in a process of its own (the device count is set before jax starts)."""
    tokens = CASES[-1]["prompt_ids"] + CASES[-1]["greedy_ids"]
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    run = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL, str(folder), json.dumps(tokens)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["wqkv_devices"] == 2 and result["norms_replicated"] == [True, True]
    # Split over two devices, each row's sums add their halves in another order: float32 logits of magnitude 8 then
    # differ by up to 1.5e-5 on some CPUs (an AMD EPYC host's XLA code path), as at every --tp in test_tensor_parallel.
    np.testing.assert_allclose(result["logits"], sequence_logits(qwen3.model, tokens), rtol=1e-5, atol=1e-4)
