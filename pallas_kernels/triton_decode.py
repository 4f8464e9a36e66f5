"""Pallas paged decode attention lowered through Triton: one query token per sequence, flash-decoding with split-K.

Grid (num_seqs, num_kv_heads, num_splits). A program owns one sequence, one kv head (all the q
heads of its GQA group as rows of one tile) and one contiguous range of page blocks; it writes an
unnormalized partial result with its softmax max and sum, and `kernel_common.combine_splits` merges them.
With few sequences the splits keep the GPU busy on long contexts; with many, num_splits is 1.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sluice.pallas_kernels import kernel_common as kc
from sluice.pallas_kernels import triton_common as tc
from sluice.pallas_kernels.kv_cache import Pages

# Triton dots need at least 16 rows.
MIN_ROWS = 16


def _decode_kernel(
    kv_lens_ref, page_table_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref,
    *, sm_scale: float, page_size: int, pages_per_block: int, blocks_per_split: int,
):
    kv_len = kv_lens_ref[0]
    num_blocks = pl.cdiv(kv_len, pages_per_block * page_size)
    first = pl.program_id(2) * blocks_per_split
    end = jnp.minimum(first + blocks_per_split, num_blocks)
    q = q_ref[...]
    q_pos = jnp.full((q.shape[0],), kv_len - 1, jnp.int32)
    acc, m, l = tc.attend_pages(
        q, q_pos, kv_len, page_table_ref, k_ref, v_ref, first, end,
        sm_scale=sm_scale, page_size=page_size, pages_per_block=pages_per_block,
    )
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_splits", "interpret"))
def paged_decode_attention_triton(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float,
    num_splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q: [num_seqs, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, num_kv_heads, page_size,
    head_dim] (arrays or int8 `QuantizedPages`); kv_lens: [num_seqs] int32; page_table: [num_seqs, max_pages_per_seq] int32.
    Returns [num_seqs, num_q_heads, head_dim] in q's dtype; rows with kv_len 0 are zeros.
    num_splits: split-K factor, chosen from the shapes when None.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    rows = max(MIN_ROWS, kc.next_power_of_2(group))
    ppb = tc.pages_per_block(page_size, head_dim)
    max_blocks = pl.cdiv(page_table.shape[1], ppb)
    if num_splits is None:
        num_splits = kc.num_splits_for(num_seqs, num_kv_heads, max_blocks)
    blocks_per_split = pl.cdiv(max_blocks, num_splits)
    num_splits = pl.cdiv(max_blocks, blocks_per_split)

    q_tiles = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    padded_pages = num_splits * blocks_per_split * ppb
    page_table = jnp.pad(page_table, ((0, 0), (0, padded_pages - page_table.shape[1])))

    kernel = functools.partial(
        _decode_kernel, sm_scale=sm_scale, page_size=page_size, pages_per_block=ppb,
        blocks_per_split=blocks_per_split,
    )
    stats_spec = pl.BlockSpec((None, None, None, rows), lambda s, h, c: (c, s, h, 0))
    stats_shape = jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, rows), jnp.float32)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, c: (s,)),
            pl.BlockSpec((None, padded_pages), lambda s, h, c: (s, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda s, h, c: (s, h, 0, 0)),
            tc.pool_spec(k_pages),
            tc.pool_spec(v_pages),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, c: (c, s, h, 0, 0)),
            stats_spec,
            stats_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, rows, head_dim), jnp.float32),
            stats_shape,
            stats_shape,
        ],
        compiler_params=tc.compiler_params(),
        interpret=interpret,
        name="paged_decode_attention",
    )(kv_lens.astype(jnp.int32), page_table.astype(jnp.int32), q_tiles, k_pages, v_pages)
    out = kc.combine_splits(acc, m, l)[:, :, :group]
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
