"""Pallas ragged paged attention lowered through Triton: chunked prefill and decode rows of many sequences in one call.

Grid (num_seqs, num_kv_heads, cdiv(max_q_len, block_q)). A program owns block_q consecutive query
tokens of one sequence and one kv head; the tokens' GQA q heads are rows of one tile (row =
token * group_rows + head), so each K/V page is read once for the whole group. Queries are laid out
`[num_kv_heads, tokens * group_rows, head_dim]` so that a sequence's rows are contiguous whatever its
start; a program loads block_q tokens from the sequence's start (the array is padded by block_q
tokens so the load stays in bounds) and stores only the rows of its own sequence (masked store).
Programs past a sequence's q_len do nothing.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from sluice.pallas_kernels import kernel_common as kc
from sluice.pallas_kernels import triton_common as tc
from sluice.pallas_kernels.kv_cache import Pages

# Rows of a query tile (tokens x group heads): a tensor-core-sized tile for prefill chunks.
TARGET_ROWS = 64
# Triton dots need at least 16 rows.
MIN_ROWS = 16


def _ragged_kernel(
    q_starts_ref, q_lens_ref, kv_lens_ref, page_table_ref, q_ref, k_ref, v_ref, o_ref,
    *, sm_scale: float, page_size: int, pages_per_block: int, block_q: int, group_rows: int,
):
    q_len = q_lens_ref[0]
    first_token = pl.program_id(2) * block_q

    @pl.when(first_token < q_len)
    def _():
        kv_len = kv_lens_ref[0]
        rows = pl.ds((q_starts_ref[0] + first_token) * group_rows, block_q * group_rows)
        token = first_token + lax.iota(jnp.int32, block_q * group_rows) // group_rows
        q_pos = kv_len - q_len + token
        last_token = jnp.minimum(q_len, first_token + block_q) - 1
        kv_end = kv_len - q_len + last_token + 1
        num_blocks = pl.cdiv(kv_end, pages_per_block * page_size)
        acc, _, l = tc.attend_pages(
            q_ref[rows], q_pos, kv_len, page_table_ref, k_ref, v_ref, 0, num_blocks,
            sm_scale=sm_scale, page_size=page_size, pages_per_block=pages_per_block,
        )
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        own = jnp.broadcast_to((token < q_len)[:, None], out.shape)
        pltr.store(o_ref.at[rows], out.astype(o_ref.dtype), mask=own)


def tile_shape(group: int, max_q_len: int) -> tuple[int, int]:
    """(block_q tokens, group_rows heads per token) of a query tile, both powers of 2."""
    group_rows = kc.next_power_of_2(group)
    block_q = min(max(1, TARGET_ROWS // group_rows), kc.next_power_of_2(max_q_len))
    block_q = max(block_q, pl.cdiv(MIN_ROWS, group_rows))
    return block_q, group_rows


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale", "interpret"))
def ragged_paged_attention_triton(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    *,
    max_q_len: int,
    sm_scale: float,
    interpret: bool = False,
) -> jax.Array:
    """q: [num_tokens, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, num_kv_heads,
    page_size, head_dim] (arrays or int8 `QuantizedPages`); kv_lens: [num_seqs] int32; page_table: [num_seqs, max_pages_per_seq]
    int32; cu_q_lens: [num_seqs + 1] int32. Returns [num_tokens, num_q_heads, head_dim] in q's
    dtype; rows at or past cu_q_lens[-1] are zeros. Semantics as `attention.ragged_paged_attention`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    num_seqs = kv_lens.shape[0]
    group = num_q_heads // num_kv_heads
    block_q, group_rows = tile_shape(group, max_q_len)
    ppb = tc.pages_per_block(page_size, head_dim)
    padded_tokens = num_tokens + block_q
    padded_pages = pl.cdiv(page_table.shape[1], ppb) * ppb

    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_rows = jnp.pad(q_rows, ((0, block_q), (0, 0), (0, group_rows - group), (0, 0)))
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group_rows, head_dim)
    page_table = jnp.pad(page_table, ((0, 0), (0, padded_pages - page_table.shape[1])))
    cu_q_lens = cu_q_lens.astype(jnp.int32)

    kernel = functools.partial(
        _ragged_kernel, sm_scale=sm_scale, page_size=page_size, pages_per_block=ppb,
        block_q=block_q, group_rows=group_rows,
    )
    per_seq = pl.BlockSpec((1,), lambda s, h, b: (s,))
    rows_spec = pl.BlockSpec((None, padded_tokens * group_rows, head_dim), lambda s, h, b: (h, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, pl.cdiv(max_q_len, block_q)),
        in_specs=[
            per_seq,
            per_seq,
            per_seq,
            pl.BlockSpec((None, padded_pages), lambda s, h, b: (s, 0)),
            rows_spec,
            tc.pool_spec(k_pages),
            tc.pool_spec(v_pages),
        ],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=tc.compiler_params(),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        cu_q_lens[:-1], cu_q_lens[1:] - cu_q_lens[:-1], kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32), q_rows, k_pages, v_pages,
    )
    out = out.reshape(num_kv_heads, padded_tokens, group_rows, head_dim)[:, :num_tokens, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    # Rows no sequence owns were never stored.
    owned = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(owned[:, None, None], out, jnp.zeros_like(out))
