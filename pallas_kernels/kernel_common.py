"""What every paged-attention kernel family shares, whatever it lowers through: masking, tile sizes, split-K.

The kernels (Triton: `triton_decode.py`, `triton_ragged.py`; Mosaic GPU: `mosaic_attention.py`) compute an
online softmax over blocks of a sequence's pages. A decode step with few sequences splits each sequence's
blocks over several programs (flash-decoding); each program returns an unnormalized partial result with its
running max and sum, and `combine_splits` merges them.
"""

import jax
import jax.numpy as jnp

# Finite, so that a fully masked row gives exp(MASK - MASK) = 1 rather than NaN before the
# `where` on the probabilities zeroes it.
MASK_VALUE = -1e30
# Enough programs to fill an H100's 132 SMs.
TARGET_PROGRAMS = 128


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def num_splits_for(num_seqs: int, num_kv_heads: int, max_blocks: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, never more than the page blocks."""
    return max(1, min(max_blocks, TARGET_PROGRAMS // (num_seqs * num_kv_heads)))


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """acc: [splits, ..., head_dim] f32; m, l: [splits, ...] f32 -> normalized [..., head_dim] f32.

    Empty splits (m = MASK_VALUE, l = 0) weigh nothing; a row with no context gives zeros.
    """
    m_all = m.max(axis=0)
    weight = jnp.exp(m - m_all)
    l_all = (weight * l).sum(axis=0)
    acc_all = (weight[..., None] * acc).sum(axis=0)
    return acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]
