"""The model's attention over the paged KV pool: per-step metadata and the `AttendFn` that uses the kernels.

All layers share one pool, stored `[num_layers, num_pages, num_kv_heads, page_size, head_dim]` and handed to
the model flat, `[num_layers * num_pages, ...]`: layer l's pages are offset by l * num_pages, so the kernels see
one pool and nothing slices (copies) a layer out of it. The reshape happens outside the layer scan: inside it,
XLA copies the whole pool in every layer, while a flat loop-carried pool is updated in place. An int8 pool
(`kv_cache.QuantizedPages`) is reshaped leaf by leaf, its scales like its values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from sluice.model.llama import AttendFn, KVCache
from sluice.pallas_kernels.attention import ragged_paged_attention
from sluice.pallas_kernels.kv_cache import write_kv


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
    meta: AttentionMetadata, pages_per_layer: int, *, sm_scale: float, backend: str = "auto", mesh: Mesh | None = None
) -> AttendFn:
    """The paged `AttendFn` for one step over a flat pool: (k, v), each
    `[num_layers * pages_per_layer, num_kv_heads, page_size, head_dim]` (arrays or `QuantizedPages`); layer l's
    pages start at l * pages_per_layer. A step of one token writes a padding token's K/V into the pool's last page
    (`write_kv`), which no page table may then hold: a server's pool keeps it as its null page.

    With a `mesh`, it runs per device on that device's KV heads (shard_map), so kernels see only local heads and
    the pool never moves between devices.
    """

    def attend(meta: AttentionMetadata, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: KVCache):
        k_pool, v_pool = kv_cache
        page_size = k_pool.shape[2]
        offset = layer * pages_per_layer
        slots = jnp.where(meta.slot_mapping >= 0, meta.slot_mapping + offset * page_size, -1)
        k_pool, v_pool = write_kv(k_pool, v_pool, k, v, slots)
        out = ragged_paged_attention(
            q, k_pool, v_pool, meta.kv_lens, meta.page_table + offset, meta.cu_q_lens,
            max_q_len=meta.max_q_len, sm_scale=sm_scale, backend=backend,
        )
        return out, (k_pool, v_pool)

    if mesh is not None:
        (axis,) = mesh.axis_names  # the tensor-parallel mesh has one axis
        heads = P(None, axis, None)  # q/k/v/out [T, heads, head_dim]
        pool = P(None, axis)  # [pages, kv_heads, ...]: values and an int8 pool's scales alike
        # The metadata goes in as an argument (replicated), not a closure: inside shard_map every array
        # must be a per-device value, and a multi-process job's metadata arrives as a global array.
        attend = jax.shard_map(
            attend, mesh=mesh, in_specs=(P(), P(), heads, heads, heads, (pool, pool)),
            out_specs=(heads, (pool, pool)), check_vma=False,
        )
    return functools.partial(attend, meta)


def flat_pool(kv_cache: KVCache) -> KVCache:
    """[num_layers, num_pages, ...] -> [num_layers * num_pages, ...]: free outside the layer scan."""
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), kv_cache)


def layered_pool(kv_cache: KVCache, num_layers: int) -> KVCache:
    """The inverse of `flat_pool`: [num_layers * num_pages, ...] -> [num_layers, num_pages, ...]."""
    return jax.tree.map(lambda x: x.reshape(num_layers, -1, *x.shape[1:]), kv_cache)
