"""Contiguous-KV-cache generation for one sequence: the plain baseline the paged engine is checked against.

Its attention is written independently of the paged kernels: one cache row of `max_len` slots per layer,
written with `dynamic_update_slice`, read densely under a causal mask.
"""

from __future__ import annotations

from functools import partial
from typing import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from sluice.model.llama import AttendFn, KVCache, Llama, empty_kv_cache


def contiguous_attend(start: jax.Array, sm_scale: float) -> AttendFn:
    """Attention over a single contiguous cache row; the T new tokens sit at positions start..start+T-1.

    The cache is `[num_layers, 1, num_kv_heads, max_len, head_dim]` (one "page" spanning the whole sequence).
    """

    def attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: KVCache):
        k_cache, v_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, max_len = k_cache.shape[2], k_cache.shape[3]
        at = (layer, 0, 0, start, 0)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(1, 0, 2)[None, None].astype(k_cache.dtype), at)
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(1, 0, 2)[None, None].astype(v_cache.dtype), at)
        keys = k_cache[layer, 0].astype(jnp.float32)  # [Hkv, max_len, Dh]
        values = v_cache[layer, 0].astype(jnp.float32)
        group = num_heads // num_kv_heads
        # Rows of a KV head's queries token-major ([Hkv, T * group, Dh]): the KV head leads both products as their
        # batch dimension, which XLA's CPU dots take as they are (twice as fast as with it in the middle).
        qg = (q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
              .reshape(num_kv_heads, num_tokens * group, head_dim))
        scores = jnp.einsum("kqd,ksd->kqs", qg, keys) * sm_scale
        query_pos = start + jnp.repeat(jnp.arange(num_tokens), group)
        visible = jnp.arange(max_len)[None, :] <= query_pos[:, None]  # [T * group, max_len]
        probs = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("kqs,ksd->kqd", probs, values).reshape(num_kv_heads, num_tokens, group, head_dim)
        return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim).astype(q.dtype), (k_cache, v_cache)

    return attend


@partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _forward_last(graphdef: nnx.GraphDef, state: nnx.State, kv_cache: KVCache, token_ids, start, last_index):
    """Runs T tokens at positions start.. and returns (logits of row last_index [vocab] float32, kv_cache)."""
    model = nnx.merge(graphdef, state)
    positions = start + jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    attend = contiguous_attend(start, model.config.softmax_scale)
    hidden, kv_cache = model(token_ids, positions, kv_cache, attend)
    return model.logits(hidden[last_index][None])[0], kv_cache


def sequence_logits(model: Llama, token_ids: list[int]) -> jax.Array:
    """Logits after every prefix of `token_ids` in one pass: [len(token_ids), vocab] float32 (teacher forcing)."""
    graphdef, state = nnx.split(model)
    kv_cache = empty_kv_cache(model.config, num_pages=1, page_size=_bucket(len(token_ids)), dtype=model.dtype)
    return _forward_all(graphdef, state, kv_cache, jnp.asarray(token_ids, jnp.int32))


@partial(jax.jit, static_argnums=(0,))
def _forward_all(graphdef: nnx.GraphDef, state: nnx.State, kv_cache: KVCache, token_ids: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    attend = contiguous_attend(jnp.int32(0), model.config.softmax_scale)
    hidden, _ = model(token_ids, positions, kv_cache, attend)
    return model.logits(hidden)


def _bucket(n: int) -> int:
    """Pads prompt lengths to powers of two (>= 16) so the prefill compiles a handful of shapes."""
    return max(16, 1 << (n - 1).bit_length())


def generate_stream(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    stop_token_ids: tuple[int, ...] = (),
) -> Iterator[int]:
    """Yields up to `max_new_tokens` tokens after `prompt_ids` (greedy when temperature == 0), ending after a stop token.

    Prefill pads the prompt up to a bucket: the padding writes garbage K/V past the prompt, which each later
    decode step overwrites before any query can see it.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    graphdef, state = nnx.split(model)
    prompt_len = len(prompt_ids)
    padded = _bucket(prompt_len)
    max_len = _bucket(max(padded, prompt_len + max_new_tokens))
    kv_cache = empty_kv_cache(model.config, num_pages=1, page_size=max_len, dtype=model.dtype)
    tokens = jnp.asarray(list(prompt_ids) + [0] * (padded - prompt_len), jnp.int32)
    logits, kv_cache = _forward_last(graphdef, state, kv_cache, tokens, jnp.int32(0), jnp.int32(prompt_len - 1))
    key = jax.random.key(seed)
    for step in range(max_new_tokens):
        if temperature > 0.0:
            token = int(jax.random.categorical(jax.random.fold_in(key, step), logits / temperature))
        else:
            token = int(jnp.argmax(logits))
        yield token
        if token in stop_token_ids or step == max_new_tokens - 1:
            return
        position = jnp.int32(prompt_len + step)
        logits, kv_cache = _forward_last(
            graphdef, state, kv_cache, jnp.asarray([token], jnp.int32), position, jnp.int32(0)
        )


def generate(model: Llama, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """All tokens of `generate_stream` as a list."""
    return list(generate_stream(model, prompt_ids, max_new_tokens, **kwargs))
