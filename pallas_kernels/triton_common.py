"""What the Triton paged-attention kernels share: their GPU lowering and the online-softmax page loop.

Lowering: the kernels are grid-style `pallas_call`s lowered through Triton (`triton.CompilerParams`,
`triton.dot`, masked `triton.store`). Checked on jax 0.10.2: the Mosaic GPU lowering (the default for
a plain `pallas_call`) has no rule for `dot_general` or `transpose` in either lowering semantics, so a
Mosaic GPU kernel's matmuls need `plgpu.wgmma` on shared-memory tiles filled by TMA copies
(`mosaic_attention.py`). The Triton path lowers for `platforms=["cuda"]` through `jax.export` and
runs with the portable `interpret=True` on the CPU; it is deprecated from jax 0.11 (still working there).

An int8 pool (`kv_cache.QuantizedPages`) goes into the kernels as a pytree of two refs, values and scales, and
each block is dequantized in registers to q's dtype as it is loaded (the dots then run as for a float pool).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from sluice.pallas_kernels.kernel_common import MASK_VALUE
from sluice.pallas_kernels.kv_cache import Pages, QuantizedPages, dequantize

# Tokens of K/V per inner step: enough columns for a tensor-core dot, small enough for registers.
BLOCK_KV_TOKENS = 64
NUM_WARPS = 4
NUM_STAGES = 2


def compiler_params() -> pltr.CompilerParams:
    """The GPU lowering of every kernel here (see the module docstring)."""
    return pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def pages_per_block(page_size: int, head_dim: int) -> int:
    """Pages gathered per inner step. Triton tiles need power-of-2 sizes, so both dims are checked."""
    for name, value in (("page_size", page_size), ("head_dim", head_dim)):
        if value & (value - 1):
            raise ValueError(f"the Pallas kernels need a power-of-2 {name}, got {value}")
    return max(1, BLOCK_KV_TOKENS // page_size)


def pool_spec(pages: Pages) -> pl.BlockSpec | QuantizedPages:
    """The block of a pool `[num_pages, num_kv_heads, page_size, head_dim]` a program of grid point
    (sequence, kv head, *) reads: all pages of its head (values and scales alike for int8 pages)."""
    num_pages, _, page_size, head_dim = pages.shape
    values = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda s, h, _: (0, h, 0, 0))
    if isinstance(pages, QuantizedPages):
        return QuantizedPages(values, pl.BlockSpec((num_pages, None, page_size), lambda s, h, _: (0, h, 0)))
    return values


def _load_pages(ref, ids: jax.Array, dtype) -> jax.Array:
    """Pages `ids` [n] of one head's pool ref -> [n * page_size, head_dim] in `dtype`."""
    if isinstance(ref, QuantizedPages):
        block = dequantize(QuantizedPages(ref.values[ids], ref.scales[ids]), dtype)
    else:
        block = ref[ids]
    return block.reshape(-1, block.shape[-1])


def attend_pages(
    q: jax.Array,
    q_pos: jax.Array,
    kv_len: jax.Array,
    page_ids_ref,
    k_ref,
    v_ref,
    first_block: jax.Array,
    end_block: jax.Array,
    *,
    sm_scale: float,
    page_size: int,
    pages_per_block: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online softmax of q against blocks [first_block, end_block) of one sequence's pages.

    q: [rows, head_dim]; q_pos: [rows] int32, row r attends kv positions <= q_pos[r]; a row the
      caller stores has q_pos < kv_len.
    page_ids_ref: [>= end_block * pages_per_block] int32, the sequence's page-table row; entries
      past the kv_len's last page may be garbage and are never dereferenced.
    k_ref, v_ref: [num_pages, page_size, head_dim], one kv head of the pool (for int8 pages, `QuantizedPages`
      of refs, scales [num_pages, page_size]).
    Returns (acc [rows, head_dim] f32 unnormalized, m [rows] f32 running max, l [rows] f32 sum).
    K/V at positions >= kv_len never reach the result, even when they hold NaN.
    """
    rows, head_dim = q.shape
    block_tokens = pages_per_block * page_size
    num_used_pages = pl.cdiv(kv_len, page_size)

    def body(block, carry):
        acc, m, l = carry
        slots = block * pages_per_block + lax.iota(jnp.int32, pages_per_block)
        ids = page_ids_ref[pl.ds(block * pages_per_block, pages_per_block)]
        ids = jnp.where(slots < num_used_pages, ids, 0)
        k = _load_pages(k_ref, ids, q.dtype)
        v = _load_pages(v_ref, ids, q.dtype)
        kv_pos = block * block_tokens + lax.iota(jnp.int32, block_tokens)
        # Slots past kv_len may hold NaN, which a zero probability would not cancel in p @ v.
        v = jnp.where((kv_pos < kv_len)[:, None], v, jnp.zeros_like(v))
        mask = kv_pos[None, :] <= q_pos[:, None]
        s = pltr.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * sm_scale
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l = alpha * l + p.sum(axis=1)
        pv = pltr.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST)
        return alpha[:, None] * acc + pv, m_new, l

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    return lax.fori_loop(first_block, end_block, body, init)
