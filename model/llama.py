"""The Llama-family decoder in Flax NNX.

Layer weights are stacked on a leading `[num_layers, ...]` axis and the layers run under `jax.lax.scan`,
so compile time does not grow with depth. The model knows nothing about how K/V are cached: each layer hands
its q/k/v to an `AttendFn`, which writes the new K/V into the cache and attends (paged in the engine,
contiguous in the baseline `generate`). Linear weights are stored `[in_features, out_features]` (`x @ w`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import ModelConfig

KVCache = tuple[jax.Array, jax.Array]
"""(k, v) as the `AttendFn` keeps them: the model only threads them through its layers."""

AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, KVCache], tuple[jax.Array, KVCache]]
"""attend(layer, q [T, Hq, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh], kv_cache) -> (out [T, Hq, Dh], kv_cache)."""

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [T, D] -> [T, D] in x's dtype; the mean of squares is taken in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions: [T] int32, inv_freq: [Dh/2] -> cos, sin: [T, 1, Dh/2] float32 (broadcast over heads)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the HF Llama layout). x: [T, H, Dh] -> [T, H, Dh]."""
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, fan_in: int) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype))


class Llama(nnx.Module):
    """Decoder-only Llama. Random init here; `model.loader` fills real weights."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = config
        L, D, F = c.num_layers, c.hidden_size, c.intermediate_size
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.embed = _init(rngs, (c.vocab_size, D), dtype, 1)
        self.attn_norm = nnx.Param(jnp.ones((L, D), dtype))
        self.wq = _init(rngs, (L, D, q_dim), dtype, D)
        self.wk = _init(rngs, (L, D, kv_dim), dtype, D)
        self.wv = _init(rngs, (L, D, kv_dim), dtype, D)
        if c.attention_bias:
            self.bq = _init(rngs, (L, q_dim), dtype, 1)
            self.bk = _init(rngs, (L, kv_dim), dtype, 1)
            self.bv = _init(rngs, (L, kv_dim), dtype, 1)
        self.wo = _init(rngs, (L, q_dim, D), dtype, q_dim)
        self.mlp_norm = nnx.Param(jnp.ones((L, D), dtype))
        self.w_gate = _init(rngs, (L, D, F), dtype, D)
        self.w_up = _init(rngs, (L, D, F), dtype, D)
        self.w_down = _init(rngs, (L, F, D), dtype, F)
        self.final_norm = nnx.Param(jnp.ones((D,), dtype))
        if not c.tie_word_embeddings:
            self.lm_head = _init(rngs, (D, c.vocab_size), dtype, D)

    def _layer_params(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS if hasattr(self, name)}

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array, kv_cache: KVCache, attend: AttendFn
    ) -> tuple[jax.Array, KVCache]:
        """token_ids, positions: [T] int32 -> (hidden [T, D] in the params dtype, updated kv_cache)."""
        c = self.config
        num_tokens = token_ids.shape[0]
        x = jnp.take(self.embed[...], token_ids, axis=0)
        cos, sin = rope_cos_sin(positions, jnp.asarray(c.rope_inv_freq(), jnp.float32))

        def layer(carry: tuple[jax.Array, KVCache], inputs: tuple[jax.Array, dict[str, jax.Array]]):
            x, kv_cache = carry
            index, p = inputs
            h = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
            q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
            if c.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q = apply_rope(q.reshape(num_tokens, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(k.reshape(num_tokens, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
            attn, kv_cache = attend(index, q, k, v, kv_cache)
            x = x + attn.reshape(num_tokens, -1).astype(x.dtype) @ p["wo"]
            h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
            x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
            return (x, kv_cache), None

        layers = (jnp.arange(c.num_layers, dtype=jnp.int32), self._layer_params())
        (x, kv_cache), _ = jax.lax.scan(layer, (x, kv_cache), layers)
        return rms_norm(x, self.final_norm[...], c.rms_norm_eps), kv_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, D] -> [N, vocab] float32. Call it only on the rows that are sampled."""
        head = self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return jnp.dot(hidden, head, preferred_element_type=jnp.float32)


def empty_kv_cache(
    config: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype, sharding: jax.sharding.Sharding | None = None
) -> KVCache:
    """A zeroed KV pool: (k, v), each `[num_layers, num_pages, num_kv_heads, page_size, head_dim]`."""
    shape = (config.num_layers, num_pages, config.num_kv_heads, page_size, config.head_dim)
    k = jnp.zeros(shape, dtype, device=sharding)
    v = jnp.zeros(shape, dtype, device=sharding)
    return k, v
