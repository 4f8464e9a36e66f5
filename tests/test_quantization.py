"""Quantized weights: the quantizers, the model over them (kernel and XLA forms alike), the converted folder,
the tensor-parallel partition of scales, and the quality guard on the real SmolLM2 against float32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_folder import write_hf_folder
from model import checkpoint
from model.config import ModelConfig
from model.generate import sequence_logits
from model.linear import KERNEL_MAX_ROWS
from model.llama import LINEAR_WEIGHTS, Llama
from model.loader import load_model
from model.quantize import quantize_int4, quantize_int8, quantize_model, resolve
from pallas_kernels import cpu_qmatmul
from sharding.rules import param_spec

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "golden_smollm2.json").read_text())["cases"]
TEXT = (DATA / "devils_dictionary_preface_and_a.txt").read_text()
TINY = ModelConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)


def test_int8_rounds_each_weight_to_within_half_a_step_of_its_channel():
    w = np.random.default_rng(0).standard_normal((3, 64, 40)).astype(np.float32)
    q, scale = quantize_int8(w, k_axis=1)
    assert q.dtype == jnp.int8 and scale.shape == (3, 40)
    assert int(jnp.abs(q.astype(jnp.int32)).max()) == 127
    error = np.abs(np.asarray(q, np.float32) * np.asarray(scale)[:, None] - w)
    assert np.all(error <= np.asarray(scale)[:, None] * (0.5 + 1e-5))


def test_int4_gives_back_weights_already_on_a_q4_1_grid_exactly():
    rng = np.random.default_rng(1)
    step = rng.uniform(0.001, 0.01, (2, 1, 24)).astype(np.float16).astype(np.float32)
    low = rng.uniform(-0.1, 0.0, (2, 1, 24)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (2, 32, 24))
    q[:, 0], q[:, 1] = 0, 15  # as GGUF's quantizer leaves every block: its min and max on the grid's ends
    w = (q * step + low).astype(np.float32)
    packed, scale, mins = quantize_int4(w, k_axis=1)
    assert packed.shape == (2, 16, 24) and packed.dtype == jnp.uint8 and scale.dtype == jnp.float16
    restored = cpu_qmatmul.unpack_q4(packed[1], scale[1], mins[1])
    np.testing.assert_array_equal(np.asarray(restored), w[1])


def test_auto_resolves_per_backend_and_unknown_modes_are_refused():
    assert resolve("auto", "cpu") in ("int8", "int4") and resolve("auto", "gpu") == "int8"
    assert resolve("none", "cpu") == "none"
    with pytest.raises(ValueError, match="choose from none, int8, int4, auto"):
        resolve("fp8")


def tiny_forward(model: Llama, tokens: np.ndarray) -> np.ndarray:
    """Every row's logits from one jitted call of T = len(tokens) rows (the layout the engine steps use)."""
    return np.asarray(sequence_logits(model, tokens.tolist()))


@pytest.mark.parametrize("quantization, tolerance", [("int8", 0.03), ("int4", 0.3)])
def test_quantized_tiny_model_tracks_the_float_model(quantization, tolerance):
    tokens = np.random.default_rng(2).integers(3, 256, 9)
    reference = tiny_forward(Llama(TINY, rngs=nnx.Rngs(0)), tokens)
    quantized = quantize_model(Llama(TINY, rngs=nnx.Rngs(0)), quantization)
    assert quantized.wqkv[...].dtype == (jnp.int8 if quantization == "int8" else jnp.uint8)
    assert quantized.embed[...].dtype == jnp.int8 and quantized.dtype == jnp.float32
    got = tiny_forward(quantized, tokens)
    np.testing.assert_allclose(got, reference, atol=tolerance * np.abs(reference).max())


@pytest.mark.skipif(not cpu_qmatmul.available(), reason="CPU kernel library not built")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_kernel_form_and_xla_form_give_the_same_logits(quantization, monkeypatch):
    model = quantize_model(Llama(TINY, rngs=nnx.Rngs(4)), quantization)
    tokens = np.random.default_rng(3).integers(3, 256, KERNEL_MAX_ROWS)
    graphdef, state = nnx.split(model)

    def forward():  # a fresh jit per form: the form is chosen while tracing
        return jax.jit(lambda s: nnx.merge(graphdef, s).logits(
            nnx.merge(graphdef, s)(jnp.asarray(tokens), jnp.arange(len(tokens)), (jnp.zeros(1),) * 2,
                                   lambda layer, q, k, v, cache: (q, cache))[0]))(state)

    with_kernels = forward()
    monkeypatch.setattr(cpu_qmatmul, "available", lambda: False)
    np.testing.assert_allclose(with_kernels, forward(), rtol=1e-4, atol=1e-4)


def test_each_quantization_converts_into_its_own_folder_and_stays_quantized_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    folder = tmp_path / "hf"
    write_hf_folder(folder, TINY, seed=5)
    tokens = [5, 17, 42, 99, 7]
    plain = load_model(str(folder), dtype="float32", quantization="none")
    int8 = load_model(str(folder), dtype="float32", quantization="int8")
    int4 = load_model(str(folder), dtype="float32", quantization="int4")
    folders = {checkpoint.checkpoint_dir(folder, tmp_path / "home", q) for q in ("none", "int8", "int4")}
    assert len(folders) == 3 and all(f.exists() for f in folders)
    assert int8.model.w_down[...].dtype == jnp.int8 and int8.model.w_down_scale[...].shape == (2, 64)
    assert int4.model.w_down[...].shape == (2, 64, 64) and int4.model.w_down_min[...].shape == (2, 4, 64)
    reference = np.asarray(sequence_logits(plain.model, tokens))
    for loaded, tolerance in ((int8, 0.03), (int4, 0.3)):
        got = np.asarray(sequence_logits(loaded.model, tokens))
        np.testing.assert_allclose(got, reference, atol=tolerance * np.abs(reference).max())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_scales_are_split_with_the_output_columns_they_scale(quantization):
    model = nnx.eval_shape(lambda: quantize_model(Llama(TINY, rngs=nnx.Rngs(0)), quantization))
    shapes = {path[0]: var.shape for path, var in nnx.to_flat_state(nnx.state(model))}
    for name in LINEAR_WEIGHTS:
        if name not in shapes:
            continue
        weight = tuple(param_spec(name, shapes[name]))
        scale = tuple(param_spec(f"{name}_scale", shapes[f"{name}_scale"]))
        if len(scale) == len(weight):  # int4 group scale: input axis in groups, split alike
            assert scale == weight, name
        else:  # per output channel: the weight's partition without its input axis
            k = LINEAR_WEIGHTS[name]
            assert scale == weight[:k] + weight[k + 1:], name


SHARDED_LOGITS = """
import numpy as np
from flax import nnx
from model.config import ModelConfig
from model.generate import sequence_logits
from model.llama import Llama
from model.quantize import quantize_model
from sharding.mesh import make_mesh
from sharding.rules import shard_model

config = ModelConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
tokens = np.random.default_rng(0).integers(3, 256, 9).tolist()
for quantization in ("int8", "int4"):
    single = np.asarray(sequence_logits(quantize_model(Llama(config, rngs=nnx.Rngs(0)), quantization), tokens))
    model = quantize_model(Llama(config, rngs=nnx.Rngs(0)), quantization)
    shard_model(model, make_mesh(2))
    assert len(model.wqkv_scale[...].sharding.device_set) == 2
    np.testing.assert_allclose(np.asarray(sequence_logits(model, tokens)), single, rtol=1e-5, atol=1e-5)
print("OK")
"""


def test_quantized_model_split_over_two_devices_gives_the_same_logits():
    root = Path(__file__).parents[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", SHARDED_LOGITS], capture_output=True, text=True, env=env,
                            cwd=root, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


# ---- The quality guard on the real weights (float32 activations, quantized weights).

AGREEMENT_STEPS = 24
MIN_TOP1_AGREEMENT = 0.95
MAX_PERPLEXITY_INCREASE = {"int8": 0.01, "int4": 0.05}


def perplexity(model: Llama, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of each token after its prefix), one teacher-forced pass."""
    logprobs = jax.nn.log_softmax(sequence_logits(model, token_ids)[:-1], axis=-1)
    picked = jnp.take_along_axis(logprobs, jnp.asarray(token_ids[1:])[:, None], axis=1)
    return float(jnp.exp(-picked.mean()))


def greedy_top1(model: Llama) -> list[list[int]]:
    """The model's argmax at each of the first AGREEMENT_STEPS steps of every golden case's float32 greedy
    path (teacher-forced, so one early flip does not count again at every later step). All cases are padded
    to one length: one compile, and padding after a position never changes its logits."""
    paths = [c["prompt_ids"] + c["greedy_ids"][: AGREEMENT_STEPS - 1] for c in GOLDEN]
    width = max(map(len, paths))
    out = []
    for case, path in zip(GOLDEN, paths):
        logits = np.asarray(sequence_logits(model, path + [0] * (width - len(path))))
        start = len(case["prompt_ids"]) - 1
        out.append(logits[start : start + AGREEMENT_STEPS].argmax(-1).tolist())
    return out


@pytest.fixture(scope="module")
def float_reference(smollm2):
    ids = smollm2.tokenizer.encode(TEXT)
    assert len(ids) >= 2000
    return ids, perplexity(smollm2.model, ids), greedy_top1(smollm2.model)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_smollm2_keeps_perplexity_and_greedy_choices(quantization, float_reference):
    ids, float_ppl, float_top1 = float_reference
    loaded = load_model(dtype="float32", quantization=quantization)
    ppl = perplexity(loaded.model, ids)
    assert ppl <= float_ppl * (1 + MAX_PERPLEXITY_INCREASE[quantization]), (ppl, float_ppl)
    top1 = greedy_top1(loaded.model)
    agreement = np.mean([a == b for got, want in zip(top1, float_top1) for a, b in zip(got, want)])
    assert agreement >= MIN_TOP1_AGREEMENT, agreement
