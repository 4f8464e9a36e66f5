"""The Flax Llama on a tiny random config: shapes, RoPE, GQA, causal masking, and a float64 NumPy decoder layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sluice.model.config import ModelConfig
from sluice.model.generate import generate, sequence_logits
from sluice.model.llama import Llama, apply_rope, fuse_qkv, rope_cos_sin, split_qkv
from sluice.model.quantize import quantize_model


@pytest.fixture(scope="module")
def tiny() -> Llama:
    return Llama(ModelConfig.tiny(), rngs=nnx.Rngs(0))


def random_tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def test_logits_have_one_row_per_token(tiny):
    logits = sequence_logits(tiny, random_tokens(11, 0))
    assert logits.shape == (11, tiny.config.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_rope_preserves_norm_and_depends_only_on_relative_position():
    inv_freq = jnp.asarray(ModelConfig.tiny().rope_inv_freq(), jnp.float32)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 16)), jnp.float32)

    def rotated(x, position):
        cos, sin = rope_cos_sin(jnp.array([position]), inv_freq)
        return apply_rope(x, cos, sin)

    np.testing.assert_allclose(jnp.linalg.norm(rotated(q, 37)), jnp.linalg.norm(q), rtol=1e-5)
    dot = lambda a, b: float(jnp.sum(rotated(q, a) * rotated(k, b)))
    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-4)
    assert dot(10, 3) != pytest.approx(dot(10, 4), rel=1e-3)


def test_llama3_rope_scaling_slows_only_low_frequencies():
    from sluice.model.config import RopeScaling

    base = ModelConfig.tiny(head_dim=64, rope_theta=500000.0)
    scaled = ModelConfig.tiny(head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    plain, slow = base.rope_inv_freq(), scaled.rope_inv_freq()
    assert slow[0] == plain[0]
    assert slow[-1] == pytest.approx(plain[-1] / 8.0)


def test_future_tokens_do_not_change_earlier_logits(tiny):
    tokens = random_tokens(12, 2)
    changed = tokens[:6] + random_tokens(6, 3)
    a, b = sequence_logits(tiny, tokens), sequence_logits(tiny, changed)
    np.testing.assert_allclose(a[:6], b[:6], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[6:], b[6:], atol=1e-3)


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    gqa_config = ModelConfig.tiny(num_heads=4, num_kv_heads=2)
    mha_config = ModelConfig.tiny(num_heads=4, num_kv_heads=4)
    gqa = Llama(gqa_config, rngs=nnx.Rngs(5))
    mha = Llama(mha_config, rngs=nnx.Rngs(6))
    for name in ("embed", "attn_norm", "wo", "mlp_norm", "w_gate_up", "w_down", "final_norm", "lm_head"):
        getattr(mha, name)[...] = getattr(gqa, name)[...]
    q, k, v = split_qkv(gqa.wqkv[...], gqa_config)  # [L, D, heads, Dh]
    mha.wqkv[...] = fuse_qkv(q.reshape(2, 64, 64), *(jnp.repeat(w, 2, axis=2).reshape(2, 64, 64) for w in (k, v)),
                             mha_config)
    tokens = random_tokens(9, 4)
    np.testing.assert_allclose(sequence_logits(gqa, tokens), sequence_logits(mha, tokens), rtol=1e-5, atol=1e-5)


def test_cached_decoding_equals_full_recompute(tiny):
    prompt = random_tokens(7, 8)
    generated = generate(tiny, prompt, 8)
    logits = sequence_logits(tiny, prompt + generated[:-1])
    assert np.argmax(np.asarray(logits[len(prompt) - 1 :]), axis=-1).tolist() == generated


def numpy_decoder_layer(x: np.ndarray, p: dict[str, np.ndarray], c: ModelConfig) -> np.ndarray:
    """One Llama layer in float64 NumPy, written from the paper's equations. x: [T, D] -> [T, D]."""
    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + c.rms_norm_eps) * w

    T = x.shape[0]
    inv_freq = c.rope_inv_freq()
    angles = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(v):
        half = v.shape[-1] // 2
        a, b = v[..., :half], v[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    h = norm(x, p["attn_norm"])
    q = rope((h @ p["wq"]).reshape(T, c.num_heads, c.head_dim))
    k = rope((h @ p["wk"]).reshape(T, c.num_kv_heads, c.head_dim))
    v = (h @ p["wv"]).reshape(T, c.num_kv_heads, c.head_dim)
    out = np.zeros_like(q)
    for head in range(c.num_heads):
        kv = head // c.q_per_kv
        scores = q[:, head] @ k[:, kv].T / np.sqrt(c.head_dim)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, head] = (weights / weights.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + out.reshape(T, -1) @ p["wo"]
    h = norm(x, p["mlp_norm"])
    gate = h @ p["w_gate"]
    return x + (gate / (1 + np.exp(-gate)) * (h @ p["w_up"])) @ p["w_down"]


def test_one_layer_matches_float64_numpy_reference():
    config = ModelConfig.tiny(num_layers=1)
    model = Llama(config, rngs=nnx.Rngs(9))
    model.attn_norm[...] = jax.random.uniform(jax.random.key(1), (1, 64), minval=0.5, maxval=1.5)
    model.final_norm[...] = jnp.ones(64)
    tokens = random_tokens(10, 10)
    params = {n: np.asarray(getattr(model, n)[...], np.float64)[0] for n in ("attn_norm", "wo", "mlp_norm", "w_down")}
    q, k, v = split_qkv(np.asarray(model.wqkv[...], np.float64)[0], config)
    params.update(wq=q.reshape(64, -1), wk=k.reshape(64, -1), wv=v.reshape(64, -1))
    params["w_gate"], params["w_up"] = np.asarray(model.w_gate_up[...], np.float64)[0].transpose(1, 0, 2)
    x = np.asarray(model.embed[...], np.float64)[tokens]
    hidden = numpy_decoder_layer(x, params, config)
    hidden = hidden / np.sqrt(np.mean(hidden**2, -1, keepdims=True) + config.rms_norm_eps)
    expected = hidden @ np.asarray(model.lm_head[...], np.float64)
    np.testing.assert_allclose(sequence_logits(model, tokens), expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_layers_stored_one_array_each_give_the_stacks_logits(quantization):
    config = ModelConfig.tiny()
    stacked = quantize_model(Llama(config, rngs=nnx.Rngs(3)), quantization)
    unstacked = quantize_model(Llama(config, rngs=nnx.Rngs(3)), quantization)
    unstacked.unstack_layers()
    assert unstacked.layers_unstacked and not stacked.layers_unstacked
    wqkv = unstacked.wqkv.get_value()
    assert len(wqkv) == config.num_layers and wqkv[1].shape == stacked.wqkv.get_value().shape[1:]
    np.testing.assert_array_equal(wqkv[1], stacked.wqkv.get_value()[1])
    tokens = random_tokens(9, 4)
    np.testing.assert_allclose(np.asarray(sequence_logits(unstacked, tokens)),
                               np.asarray(sequence_logits(stacked, tokens)), rtol=1e-5, atol=1e-5)
