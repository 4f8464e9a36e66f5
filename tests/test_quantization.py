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
import gguf
import pytest
from flax import nnx

from hf_folder import write_hf_folder
from sluice.model import checkpoint
from sluice.model.config import ModelConfig
from sluice.model.generate import sequence_logits
from sluice.model.linear import Weight, dequantize
from sluice.model.llama import LINEAR_WEIGHTS, Llama
from sluice.model.loader import load_model
from sluice.model.quantize import packed_order, quantize_model, quantize_q4, quantize_q8, resolve
from sluice.pallas_kernels import cpu_qmatmul
from sluice.sharding.rules import param_spec

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "golden_smollm2.json").read_text())["cases"]
TEXT = (DATA / "devils_dictionary_preface_and_a.txt").read_text()
TINY = ModelConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)


def gguf_round_trip(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a GGUF file of that type holds for `w` [N, K] (rows along K, as ggml stores them), as [K, N]."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).T


@pytest.mark.parametrize("qtype, quantize", [(gguf.GGMLQuantizationType.Q8_0, quantize_q8),
                                             (gguf.GGMLQuantizationType.Q4_1, quantize_q4)])
def test_a_gguf_tensor_of_the_same_block_format_converts_without_loss(qtype, quantize):
    w = gguf_round_trip(np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32), qtype)
    weight = Weight(*quantize(jnp.asarray(w)))
    np.testing.assert_array_equal(np.asarray(dequantize(weight, jnp.float32)), w)


def test_q8_rounds_each_weight_to_within_half_a_step_of_its_block():
    w = np.random.default_rng(1).standard_normal((64, 2, 32)).astype(np.float32)
    weight = Weight(*quantize_q8(jnp.asarray(w)))
    assert weight.values.dtype == jnp.int8 and weight.values.shape == (2, 2, 16, 16, 4)
    step = np.repeat(np.asarray(cpu_qmatmul.unpack_scales(weight.scale), np.float32), cpu_qmatmul.BLOCK, axis=0)
    error = np.abs(np.asarray(dequantize(weight, jnp.float32)) - w)
    assert np.all(error <= step * 0.5 + 1e-6) and np.abs(np.asarray(cpu_qmatmul.unpack_q8(weight.values))).max() == 127


def test_auto_resolves_per_backend_and_unknown_modes_are_refused():
    assert resolve("auto", "cpu", cpu_kernels=True) == "int4" and resolve("auto", "gpu") == "none"
    assert resolve("none", "cpu") == "none"
    with pytest.raises(ValueError, match="choose from none, int8, int4, auto"):
        resolve("fp8")


def test_auto_takes_float_weights_where_only_the_untimed_portable_kernels_build(monkeypatch):
    """The portable build (SIMDe, an ARM64 CPU's) computes what the x86 ones do, but its speed on the CPUs it is
    for is not measured: "auto" keeps the float weights there, and int4 stays one flag away."""
    from sluice.pallas_kernels import cpu_build, cpu_library

    assert resolve("auto", "cpu") == "int4"  # this CPU's x86 build
    library = cpu_library.load()
    monkeypatch.setattr(cpu_library, "load", lambda: library._replace(variant=cpu_build.PORTABLE))
    assert resolve("auto", "cpu") == "none" and resolve("int4", "cpu") == "int4"


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


def test_int8_per_channel_keeps_the_float_shapes_and_tracks_the_float_model():
    """The GPU's int8 form (`model.quantize`): values int8 of the float weight's shape, a float32 scale per output
    feature, each weight within half a step of its scale."""
    tokens = np.random.default_rng(2).integers(3, 256, 9)
    model = Llama(TINY, rngs=nnx.Rngs(0))
    floats = {name: np.asarray(getattr(model, name)[...]) for name in LINEAR_WEIGHTS if hasattr(model, name)}
    reference = tiny_forward(model, tokens)
    quantized = quantize_model(Llama(TINY, rngs=nnx.Rngs(0)), "int8", layout="channel")
    for name, w in floats.items():
        values, scale = np.asarray(getattr(quantized, name)[...]), np.asarray(getattr(quantized, f"{name}_scale")[...])
        k = LINEAR_WEIGHTS[name]
        assert values.dtype == np.int8 and values.shape == w.shape and scale.dtype == np.float32, name
        assert scale.shape == w.shape[:k] + w.shape[k + 1:] and np.abs(values).max() == 127, name
        assert np.all(np.abs(values * np.expand_dims(scale, k) - w) <= np.expand_dims(scale, k) * 0.5 + 1e-6), name
    np.testing.assert_allclose(tiny_forward(quantized, tokens), reference, atol=0.03 * np.abs(reference).max())


def logits_of(model: Llama, tokens: np.ndarray) -> np.ndarray:
    """One forward over `tokens` with attention replaced by the identity: the projections alone decide it.
    A fresh jit per call, since how weights are multiplied is chosen while tracing."""
    graphdef, state = nnx.split(model)

    def forward(s):
        m = nnx.merge(graphdef, s)
        identity = lambda layer, q, k, v, cache: (q, cache)
        return m.logits(m(jnp.asarray(tokens), jnp.arange(len(tokens)), (jnp.zeros(1),) * 2, identity)[0])

    return np.asarray(jax.jit(forward)(state))


@pytest.fixture(params=["int8", "int4"])
def tiny_through_kernels(request) -> tuple[Llama, np.ndarray, np.ndarray]:
    """A quantized tiny model, tokens, and its logits through the CPU kernels."""
    if not cpu_qmatmul.available():
        pytest.skip("CPU kernel library not built")
    model = quantize_model(Llama(TINY, rngs=nnx.Rngs(4)), request.param)
    tokens = np.random.default_rng(3).integers(3, 256, 13)
    return model, tokens, logits_of(model, tokens)


def test_kernels_in_the_model_compute_what_their_references_do(tiny_through_kernels, monkeypatch):
    model, tokens, with_kernels = tiny_through_kernels
    monkeypatch.setattr(cpu_qmatmul, "q8_q8", cpu_qmatmul.q8_q8_ref)
    monkeypatch.setattr(cpu_qmatmul, "q4_q8", cpu_qmatmul.q4_q8_ref)
    np.testing.assert_allclose(with_kernels, logits_of(model, tokens), rtol=1e-4, atol=1e-4)


def test_without_kernels_the_weights_are_dequantized_and_agree_with_the_kernels(tiny_through_kernels, monkeypatch):
    model, tokens, with_kernels = tiny_through_kernels
    monkeypatch.setattr(cpu_qmatmul, "available", lambda: False)
    weight_only = logits_of(model, tokens)  # activations not quantized: close, not equal
    np.testing.assert_allclose(with_kernels, weight_only, atol=0.02 * np.abs(weight_only).max())


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
    # w_down [layers 2, intermediate 128, hidden 64]: 4 panels of 16 outputs, 32 (Q8_0) or 16 (Q4_1) packs of inputs.
    assert int8.model.w_down[...].dtype == jnp.int8 and int8.model.w_down[...].shape == (2, 4, 32, 16, 4)
    assert int4.model.w_down[...].shape == (2, 4, 16, 16, 4) and int4.model.w_down_min[...].shape == (2, 4, 4, 16)
    reference = np.asarray(sequence_logits(plain.model, tokens))
    for loaded, tolerance in ((int8, 0.03), (int4, 0.3)):
        got = np.asarray(sequence_logits(loaded.model, tokens))
        np.testing.assert_allclose(got, reference, atol=tolerance * np.abs(reference).max())


def test_where_the_cpu_kernels_do_not_run_int8_converts_per_channel_into_a_folder_of_its_own(tmp_path, monkeypatch):
    """A GPU machine's load (`model.quantize.default_layout`): the conversion and the restore target agree on the
    per-channel form, kept apart from the packed conversion."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cpu_qmatmul, "available", lambda: False)
    folder = tmp_path / "hf"
    write_hf_folder(folder, TINY, seed=5)
    tokens = [5, 17, 42, 99, 7]
    plain = load_model(str(folder), dtype="float32", quantization="none")
    int8 = load_model(str(folder), dtype="float32", quantization="int8")
    assert checkpoint.checkpoint_dir(folder, tmp_path / "home", "int8-channel").exists()
    assert not checkpoint.checkpoint_dir(folder, tmp_path / "home", "int8").exists()
    assert int8.model.w_down[...].dtype == jnp.int8 and int8.model.w_down[...].shape == plain.model.w_down[...].shape
    assert int8.model.w_down_scale[...].dtype == jnp.float32 and int8.model.w_down_scale[...].shape == (2, 64)
    reference = np.asarray(sequence_logits(plain.model, tokens))
    got = np.asarray(sequence_logits(int8.model, tokens))
    np.testing.assert_allclose(got, reference, atol=0.03 * np.abs(reference).max())


def abstract_shapes(make) -> dict[str, tuple[int, ...]]:
    return {path[0]: var.shape for path, var in nnx.to_flat_state(nnx.state(nnx.eval_shape(make)))}


def test_per_channel_values_are_split_like_the_float_weight_and_their_scales_without_its_input_axis():
    float_shapes = abstract_shapes(lambda: Llama(TINY, rngs=nnx.Rngs(0)))
    shapes = abstract_shapes(lambda: quantize_model(Llama(TINY, rngs=nnx.Rngs(0)), "int8", layout="channel"))
    for name in LINEAR_WEIGHTS.keys() & float_shapes.keys():
        spec = tuple(param_spec(name, float_shapes[name]))
        assert tuple(param_spec(name, shapes[name])) == spec, name
        without_k = spec[:LINEAR_WEIGHTS[name]] + spec[LINEAR_WEIGHTS[name] + 1:]
        assert tuple(param_spec(f"{name}_scale", shapes[f"{name}_scale"])) == without_k, name


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_values_scales_and_mins_are_split_like_the_float_weight_in_packed_order(quantization):
    float_shapes = abstract_shapes(lambda: Llama(TINY, rngs=nnx.Rngs(0)))
    shapes = abstract_shapes(lambda: quantize_model(Llama(TINY, rngs=nnx.Rngs(0)), quantization))
    for name in LINEAR_WEIGHTS.keys() & float_shapes.keys():
        packed = packed_order(name, tuple(param_spec(name, float_shapes[name])))
        for part in (name, f"{name}_scale", f"{name}_min"):
            if part in shapes:
                assert tuple(param_spec(part, shapes[part])) == packed, part


SHARDED_LOGITS = """
import numpy as np
from flax import nnx
from sluice.model.config import ModelConfig
from sluice.model.generate import sequence_logits
from sluice.model.llama import Llama
from sluice.model.quantize import quantize_model
from sluice.sharding.mesh import make_mesh
from sluice.sharding.rules import shard_model

config = ModelConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
tokens = np.random.default_rng(0).integers(3, 256, 9).tolist()
for quantization, layout in (("int8", "packed"), ("int4", "packed"), ("int8", "channel")):
    single = np.asarray(sequence_logits(quantize_model(Llama(config, rngs=nnx.Rngs(0)), quantization, layout), tokens))
    model = quantize_model(Llama(config, rngs=nnx.Rngs(0)), quantization, layout)
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
MAX_PERPLEXITY_INCREASE = {"int8": 0.01, "int4": 0.05, "int8-channel": 0.02}
# The text's first 2048 tokens (of 2301): sequence_logits pads its cache to a power of two and attends over all
# of it, so the whole text would pad to 4096 and take twice as long (32 s a model, not 16, on 2 cores).
PERPLEXITY_TOKENS = 2048


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
    ids = smollm2.tokenizer.encode(TEXT)[:PERPLEXITY_TOKENS]
    assert len(ids) == PERPLEXITY_TOKENS
    return ids, perplexity(smollm2.model, ids), greedy_top1(smollm2.model)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4", "int8-channel"])
def test_quantized_smollm2_keeps_perplexity_and_greedy_choices(quantization, float_reference):
    """"int8-channel": the GPU's int8 form (`model.quantize`), here through XLA's dot."""
    ids, float_ppl, float_top1 = float_reference
    if quantization == "int8-channel":
        loaded = load_model(dtype="float32")
        quantize_model(loaded.model, "int8", layout="channel")
    else:
        loaded = load_model(dtype="float32", quantization=quantization)
    ppl = perplexity(loaded.model, ids)
    assert ppl <= float_ppl * (1 + MAX_PERPLEXITY_INCREASE[quantization]), (ppl, float_ppl)
    top1 = greedy_top1(loaded.model)
    agreement = np.mean([a == b for got, want in zip(top1, float_top1) for a, b in zip(got, want)])
    assert agreement >= MIN_TOP1_AGREEMENT, agreement
