"""The paged KV cache: page layout, its int8 form, and the in-place write of new tokens' K/V.

Layout, per layer: `k_pages`, `v_pages`: `[num_pages, num_kv_heads, page_size, head_dim]`.

Head-major within a page: the attention kernels work on one (sequence, kv_head) pair at a time and
read, from each page, the `[page_size, head_dim]` tile of that one head. With heads inside the page
that tile is one contiguous block (page_size * head_dim elements, e.g. 4 KiB for 16 x 128 bf16), so
each page read is a single coalesced copy; token-major pages (`[page_size, num_kv_heads, head_dim]`)
would turn it into page_size strided rows of head_dim each. K and V are separate arrays rather than
interleaved: the GPU kernels load K and V as separate tiles anyway (interleaving pays off for a
single-DMA TPU design), and separate arrays keep the write and the references simple.

int8 (`--kv-cache-dtype int8`): K and V are each a `QuantizedPages`, the same layout in int8 plus one float32
scale per (page, head, token) row of head_dim values: symmetric, `scale = max|x| / 127` and
`values = round(x / scale)`, so a row reads back as `values * scale`, within scale / 2 of what was written
(an all-zero row has scale 0 and values 0). A scale per token means a write never rescales what a page
already holds; a scale per head means a tensor-parallel shard, which holds whole heads, quantizes exactly as
one device does. At head_dim 64 a token's K or V row is 68 bytes per head instead of 256 in float32.

The model keeps all layers in one array `[num_layers, num_pages, ...]` (values and scales alike), reshapes it
(free) to `[num_layers * num_pages, ...]` inside its layer scan and offsets page ids / slots by the layer, so
the functions here and in `attention.py` only ever see one flat page pool.

A token's slot is `page * page_size + offset_in_page`; a negative slot marks a padding token. A pool the model
steps on holds one page per layer more than its owner hands out (`ModelRunner.pool_pages`): the flat pool's last
page is then no page table's, the null page a lone padding token's write may land in (`write_kv`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("auto", "int8")
"""`--kv-cache-dtype` choices: "auto" keeps K/V in the model's activation dtype."""
INT8_MAX = 127


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedPages:
    """K or V pages in int8 with a scale per row.

    values: [..., num_pages, num_kv_heads, page_size, head_dim] int8
    scales: [..., num_pages, num_kv_heads, page_size] float32 (the leading axes are the values')
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.values.dtype


Pages = jax.Array | QuantizedPages
"""One of K or V over the pool, as the kernels take it: an array of the activation dtype, or int8 pages."""


def kv_cache_dtype(choice: str, activation_dtype, backend: str | None = None) -> jnp.dtype:
    """The pool's dtype for a `--kv-cache-dtype` choice (one of KV_CACHE_DTYPES, checked by `EngineConfig`) on
    `backend` (default: JAX's). "auto" is the activation dtype, but float32 on a CPU: XLA:CPU writes rows into a
    bfloat16 or float16 array by converting all of it to float32 and back, a pass over the whole pool per layer
    and step (seconds a step for a pool of a few GiB)."""
    if choice == "int8":
        return jnp.dtype(jnp.int8)
    return jnp.dtype(jnp.float32 if (backend or jax.default_backend()) == "cpu" else activation_dtype)


def row_bytes(head_dim: int, dtype) -> int:
    """Bytes one token's K (or V) takes for one head in a pool of `dtype`, an int8 row's scale included."""
    dtype = jnp.dtype(dtype)
    return head_dim * dtype.itemsize + (jnp.dtype(jnp.float32).itemsize if dtype == jnp.int8 else 0)


def empty_pages(shape: tuple[int, ...], dtype, device=None) -> Pages:
    """Zeroed pages `shape` (`[..., num_pages, num_kv_heads, page_size, head_dim]`), int8 ones with zero scales.
    `device`: a device or sharding, the same for an int8 pool's scales (a sharding of the pool splits only axes
    the scales share with the values: `sharding.rules.KV_CACHE_SPEC`)."""
    if jnp.dtype(dtype) == jnp.int8:
        scales = jnp.zeros(shape[:-1], jnp.float32, device=device)
        return QuantizedPages(jnp.zeros(shape, jnp.int8, device=device), scales)
    return jnp.zeros(shape, dtype, device=device)


def quantize(x: jax.Array) -> QuantizedPages:
    """x: [..., head_dim] -> values [..., head_dim] int8, scales [...] float32 (per row, symmetric)."""
    x = x.astype(jnp.float32)
    scales = jnp.abs(x).max(axis=-1) / INT8_MAX
    safe = jnp.where(scales > 0, scales, 1.0)
    values = jnp.clip(jnp.round(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedPages(values, scales)


def dequantize(pages: QuantizedPages, dtype=jnp.float32) -> jax.Array:
    """values [..., head_dim] int8, scales [...] -> [..., head_dim] in `dtype` (multiplied in float32)."""
    return (pages.values.astype(jnp.float32) * pages.scales[..., None].astype(jnp.float32)).astype(dtype)


def _scatter(pages: Pages, x: jax.Array, page: jax.Array, offset: jax.Array) -> Pages:
    """Writes rows x [T, num_kv_heads, head_dim] at (page[t], :, offset[t]); a page past the pool drops the row
    (a lone row's, written by a dynamic-update-slice, would be clamped into the pool instead)."""
    if isinstance(pages, QuantizedPages):
        rows = quantize(x)
        return QuantizedPages(_scatter(pages.values, rows.values, page, offset),
                              _scatter(pages.scales, rows.scales, page, offset))
    x = x.astype(pages.dtype)
    if x.shape[0] == 1:
        start = (page[0], 0, offset[0]) + (0,) * (pages.ndim - 3)
        return jax.lax.dynamic_update_slice(pages, jnp.expand_dims(x, 2), start)
    return pages.at[page, :, offset].set(x, mode="drop")


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(
    k_pages: Pages,
    v_pages: Pages,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[Pages, Pages]:
    """Scatters the new tokens' K/V into their slots of the page pool.

    k_pages, v_pages: [num_pages, num_kv_heads, page_size, head_dim], or `QuantizedPages` of that shape
      (donated: updated in place)
    k, v: [num_tokens, num_kv_heads, head_dim], cast to the pool's dtype (quantized per row for int8 pages)
    slot_mapping: [num_tokens] int32; a negative slot (padding) writes no page a page table holds: several tokens'
      padding is dropped, a lone token's goes to the pool's last slot, in its null page (module docstring)
    Returns the updated (k_pages, v_pages).

    Called standalone, the pool buffers are donated and the scatter reuses them (no copy of the
    pool); called inside a bigger jit, this inlines and the caller's donation decides.
    A lone token (a one-row decode step) is written by a dynamic-update-slice, which XLA runs in place with no
    bounds to check; XLA makes a scatter of one row one too, but one that first reads the row it overwrites (to keep
    it where the write is dropped): on a GPU a kernel more per layer (Llama-3-8B's one-row step: 498 launches,
    461 without).
    """
    num_pages, _, page_size, _ = k_pages.shape
    if slot_mapping.shape[0] == 1:
        slot_mapping = jnp.where(slot_mapping < 0, num_pages * page_size - 1, slot_mapping)
    # An out-of-range page index makes the scatter's mode="drop" skip the padding token.
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)
    offset = slot_mapping % page_size
    return _scatter(k_pages, k, page, offset), _scatter(v_pages, v, page, offset)
