"""Pure-jnp paged attention: the CPU serving path and the kernels' oracle.

Cost follows the work: sequences are sorted by context length and taken in groups of ROW_GROUP, and each
group walks only as many 128-token blocks of its pages as its longest sequence needs, so a batch of mixed
lengths costs about the sum of its contexts, not num_seqs x the longest. Each block's pages are gathered
head-major, queries are laid out `[num_seqs, q_len, num_kv_heads, group, head_dim]` (a decode step costs
num_seqs x context, not num_tokens x num_seqs x context), and GQA reshapes the q heads into [kv_heads, group]
instead of repeating K/V. Masks use a finite large negative, so no row ever becomes NaN. An int8 pool
(`kv_cache.QuantizedPages`) is dequantized block by block as it is gathered, to float32.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sluice.pallas_kernels.kv_cache import Pages, QuantizedPages, dequantize

MASK_VALUE = -1e30
BLOCK_TOKENS = 128
ROW_GROUP = 8
# Up to this many query rows per KV head, the score and PV contractions are broadcast multiply-reduces: XLA's
# CPU batched dot is slow for a handful of rows, while a multiply-reduce fuses into one vectorized loop.
FEW_ROWS = 8


def _gather_head_major(pages: Pages, page_ids: jax.Array) -> jax.Array:
    """pages: [num_pages, kv_heads, page_size, head_dim] (an array, or `QuantizedPages`, returned dequantized
    to float32); page_ids: [num_seqs, max_pages] (in range).

    Returns [num_seqs, kv_heads, max_pages * page_size, head_dim]. Gathering (page, head) rows of
    the pool viewed as [num_pages * kv_heads, page_size * head_dim] lands K/V head-major in one pass,
    so the attention dots need no transposed copy (XLA's CPU dots want the batch dims leading).
    """
    if isinstance(pages, QuantizedPages):
        scales = _gather_head_major(pages.scales[..., None], page_ids)[..., 0]
        return dequantize(QuantizedPages(_gather_head_major(pages.values, page_ids), scales))
    num_pages, kv_heads, page_size, head_dim = pages.shape
    rows = page_ids[:, None, :] * kv_heads + jnp.arange(kv_heads)[None, :, None]
    out = pages.reshape(num_pages * kv_heads, page_size * head_dim)[rows]
    return out.reshape(page_ids.shape[0], kv_heads, page_ids.shape[1] * page_size, head_dim)


def _scores(k: jax.Array, q_rows: jax.Array) -> jax.Array:
    """k: [s, kv_heads, block, head_dim], q_rows: [s, kv_heads, rows, head_dim] -> [s, kv_heads, block, rows] f32."""
    if q_rows.shape[2] <= FEW_ROWS:
        return (k[:, :, :, None, :].astype(jnp.float32) * q_rows[:, :, None, :, :].astype(jnp.float32)).sum(-1)
    return jnp.einsum(
        "sktd,skrd->sktr", k, q_rows, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST
    )


def _weighted_values(v: jax.Array, p: jax.Array) -> jax.Array:
    """v: [s, kv_heads, block, head_dim], p: [s, kv_heads, block, rows] f32 -> [s, kv_heads, rows, head_dim] f32."""
    if p.shape[3] <= FEW_ROWS:
        return (v[:, :, :, None, :].astype(jnp.float32) * p[..., None]).sum(2)
    return jnp.einsum(
        "sktd,sktr->skrd", v, p.astype(v.dtype), preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST,
    )


def _attend_rows(
    q: jax.Array,
    q_pos: jax.Array,
    q_valid: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    sm_scale: float,
) -> jax.Array:
    """q: [num_seqs, q_len, kv_heads, group, head_dim]; q_pos, q_valid: [num_seqs, q_len].

    A valid row (q_pos < kv_len) attends kv positions <= q_pos of its sequence; K/V past kv_len (and
    page-table entries past the last used page) are never read into the result. Invalid rows are
    zeros. Returns [num_seqs, q_len, kv_heads, group, head_dim] in q's dtype.

    The context is walked in blocks of BLOCK_TOKENS with an online softmax, for as many blocks as the
    longest sequence in this call needs (a dynamic trip count): the cost follows the real contexts, not
    the page table's width (max_model_len). `_attend` calls this per group of similar lengths.
    """
    num_seqs, q_len, kv_heads, group, head_dim = q.shape
    max_pages = page_table.shape[1]
    page_size = k_pages.shape[2]
    pages_per_block = max(1, BLOCK_TOKENS // page_size)
    block = pages_per_block * page_size
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    page_table = jnp.pad(page_table, ((0, 0), (0, padded_pages - max_pages)))
    num_used_pages = -(-kv_lens // page_size)
    num_blocks = -(-jnp.max(num_used_pages, initial=0) // pages_per_block)

    rows = q_len * group
    # Query rows r = (i, g) of each kv head: [num_seqs, kv_heads, q_len * group, head_dim].
    q_rows = q.transpose(0, 2, 1, 3, 4).reshape(num_seqs, kv_heads, rows, head_dim)
    row_pos = jnp.repeat(q_pos, group, axis=1)  # [num_seqs, rows]

    def step(b, carry):
        m, l, acc = carry
        first_page = b * pages_per_block
        ids = lax.dynamic_slice_in_dim(page_table, first_page, pages_per_block, axis=1)
        used = first_page + jnp.arange(pages_per_block)[None, :] < num_used_pages[:, None]
        ids = jnp.where(used, ids, 0)
        k = _gather_head_major(k_pages, ids)  # [num_seqs, kv_heads, block, head_dim]
        v = _gather_head_major(v_pages, ids)
        kv_pos = b * block + jnp.arange(block)
        # Slots past kv_len may hold NaN, which a zero probability would not cancel.
        v = jnp.where((kv_pos[None, :] < kv_lens[:, None])[:, None, :, None], v, jnp.zeros_like(v))
        s = _scores(k, q_rows) * sm_scale
        visible = (kv_pos[None, :, None] <= row_pos[:, None, :])[:, None]  # [num_seqs, 1, block, rows]
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=2))
        p = jnp.where(visible, jnp.exp(s - m_new[:, :, None, :]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = _weighted_values(v, p)
        return m_new, l * alpha + p.sum(axis=2), acc * alpha[..., None] + pv

    init = (
        jnp.full((num_seqs, kv_heads, rows), MASK_VALUE, jnp.float32),
        jnp.zeros((num_seqs, kv_heads, rows), jnp.float32),
        jnp.zeros((num_seqs, kv_heads, rows, head_dim), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, num_blocks, step, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.reshape(num_seqs, kv_heads, q_len, group, head_dim).transpose(0, 2, 1, 3, 4)
    return jnp.where(q_valid[:, :, None, None, None], out, 0.0).astype(q.dtype)


def _attend(
    q: jax.Array,
    q_pos: jax.Array,
    q_valid: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    sm_scale: float,
) -> jax.Array:
    """`_attend_rows` over groups of ROW_GROUP sequences sorted by kv_len, longest first, so each group's
    block loop runs for about its own rows' contexts. Same arguments and result."""
    num_seqs = q.shape[0]
    size = min(ROW_GROUP, num_seqs)
    num_groups = -(-num_seqs // size)
    order = jnp.argsort(-kv_lens, stable=True)

    def grouped(x: jax.Array) -> jax.Array:  # padding sequences have kv_len 0 and no valid rows
        x = jnp.pad(x[order], [(0, num_groups * size - num_seqs)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_groups, size, *x.shape[1:])

    qs, q_pos, q_valid, kv_lens, page_table = map(grouped, (q, q_pos, q_valid, kv_lens, page_table))

    def one_group(i: jax.Array, out: jax.Array) -> jax.Array:
        rows = _attend_rows(qs[i], q_pos[i], q_valid[i], k_pages, v_pages, kv_lens[i], page_table[i], sm_scale)
        return lax.dynamic_update_index_in_dim(out, rows, i, axis=0)

    out = lax.fori_loop(0, num_groups, one_group, jnp.zeros_like(qs))
    out = out.reshape(num_groups * size, *q.shape[1:])[:num_seqs]
    return jnp.zeros_like(q).at[order].set(out)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def paged_decode_attention_ref(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    sm_scale: float,
) -> jax.Array:
    """q: [num_seqs, num_q_heads, head_dim], the query at position kv_lens[s] - 1.
    Returns [num_seqs, num_q_heads, head_dim] in q's dtype; rows with kv_len 0 are zeros.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    q5 = q.reshape(num_seqs, 1, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = _attend(
        q5, (kv_lens - 1)[:, None], (kv_lens > 0)[:, None],
        k_pages, v_pages, kv_lens, page_table, sm_scale,
    )
    return out.reshape(num_seqs, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("max_q_len", "sm_scale"))
def ragged_paged_attention_ref(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    *,
    max_q_len: int,
    sm_scale: float,
) -> jax.Array:
    """q: [num_tokens, num_q_heads, head_dim]; sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1],
    its i-th at position kv_lens[s] - q_len_s + i. Returns [num_tokens, num_q_heads, head_dim] in
    q's dtype; rows no sequence owns are zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = kv_lens.shape[0]
    num_kv_heads = k_pages.shape[1]
    q_starts = cu_q_lens[:-1]
    q_lens = cu_q_lens[1:] - q_starts
    i = jnp.arange(max_q_len)
    valid = i[None, :] < q_lens[:, None]  # [num_seqs, max_q_len]
    rows = jnp.where(valid, q_starts[:, None] + i[None, :], 0)
    q5 = q[rows].reshape(num_seqs, max_q_len, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    q_pos = (kv_lens - q_lens)[:, None] + i[None, :]
    out = _attend(q5, q_pos, valid, k_pages, v_pages, kv_lens, page_table, sm_scale)
    out = out.reshape(num_seqs * max_q_len, num_q_heads, head_dim)
    dest = jnp.where(valid, rows, num_tokens).reshape(-1)
    return jnp.zeros_like(q).at[dest].set(out, mode="drop")
