"""The model's attention over the paged KV pool: per-step metadata and the `AttendFn` that uses the kernels.

All layers share one pool `[num_layers, num_pages, num_kv_heads, page_size, head_dim]`. Inside the layer scan
the pool is viewed (a free reshape) as `[num_layers * num_pages, ...]` and layer l's pages are offset by
l * num_pages, so the kernels see one flat pool and nothing slices (copies) a layer out of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from model.llama import AttendFn, KVCache
from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.kv_cache import write_kv
from sharding.mesh import TP_AXIS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go and what they attend to.

    slot_mapping: [T] int32, page * page_size + offset for each token; -1 for padding tokens.
    kv_lens: [S] int32, context length of each sequence including this step's tokens (0 for padding rows).
    page_table: [S, max_pages] int32, each sequence's pages in order (unused entries arbitrary).
    cu_q_lens: [S + 1] int32, sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1].
    max_q_len: static bound on any sequence's query count this step (1 for a decode-only step).
    """

    slot_mapping: jax.Array
    kv_lens: jax.Array
    page_table: jax.Array
    cu_q_lens: jax.Array
    max_q_len: int = field(metadata=dict(static=True))


def make_paged_attend(
    meta: AttentionMetadata, *, sm_scale: float, backend: str = "auto", mesh: Mesh | None = None
) -> AttendFn:
    """The paged `AttendFn` for one step. With a `mesh`, it runs per device on that device's KV heads (shard_map),
    so kernels see only local heads and the pool never moves between devices."""

    def attend(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: KVCache):
        k_cache, v_cache = kv_cache
        num_layers, num_pages, *page_shape = k_cache.shape
        page_size = page_shape[1]
        k_pool = k_cache.reshape(num_layers * num_pages, *page_shape)
        v_pool = v_cache.reshape(num_layers * num_pages, *page_shape)
        page_offset = layer * num_pages
        slots = jnp.where(meta.slot_mapping >= 0, meta.slot_mapping + page_offset * page_size, -1)
        k_pool, v_pool = write_kv(k_pool, v_pool, k.astype(k_pool.dtype), v.astype(v_pool.dtype), slots)
        out = ragged_paged_attention(
            q, k_pool, v_pool, meta.kv_lens, meta.page_table + page_offset, meta.cu_q_lens,
            max_q_len=meta.max_q_len, sm_scale=sm_scale, backend=backend,
        )
        return out, (k_pool.reshape(k_cache.shape), v_pool.reshape(v_cache.shape))

    if mesh is None:
        return attend
    heads = P(None, TP_AXIS, None)  # q/k/v/out [T, heads, head_dim]
    pool = P(None, None, TP_AXIS, None, None)
    return jax.shard_map(
        attend, mesh=mesh, in_specs=(P(), heads, heads, heads, (pool, pool)), out_specs=(heads, (pool, pool)),
        check_vma=False,
    )
