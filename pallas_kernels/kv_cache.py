"""The paged KV cache: page layout and the in-place write of new tokens' K/V.

Layout, per layer: `k_pages`, `v_pages`: `[num_pages, num_kv_heads, page_size, head_dim]`.

Head-major within a page: the attention kernels work on one (sequence, kv_head) pair at a time and
read, from each page, the `[page_size, head_dim]` tile of that one head. With heads inside the page
that tile is one contiguous block (page_size * head_dim elements, e.g. 4 KiB for 16 x 128 bf16), so
each page read is a single coalesced copy; token-major pages (`[page_size, num_kv_heads, head_dim]`)
would turn it into page_size strided rows of head_dim each. K and V are separate arrays rather than
interleaved: the GPU kernels load K and V as separate tiles anyway (interleaving pays off for a
single-DMA TPU design), and separate arrays keep the write and the references simple.

The model keeps all layers in one array `[num_layers, num_pages, ...]`, reshapes it (free) to
`[num_layers * num_pages, ...]` inside its layer scan and offsets page ids / slots by the layer, so the
functions here and in `attention.py` only ever see one flat page pool.

A token's slot is `page * page_size + offset_in_page`; a negative slot marks a padding token.
"""

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatters the new tokens' K/V into their slots of the page pool.

    k_pages, v_pages: [num_pages, num_kv_heads, page_size, head_dim] (donated: updated in place)
    k, v: [num_tokens, num_kv_heads, head_dim], cast to the pool's dtype
    slot_mapping: [num_tokens] int32; a negative slot writes nothing
    Returns the updated (k_pages, v_pages).

    Called standalone, the pool buffers are donated and the scatter reuses them (no copy of the
    pool); called inside a bigger jit, this inlines and the caller's donation decides.
    """
    num_pages, _, page_size, _ = k_pages.shape
    # An out-of-range page index makes mode="drop" skip the padding token.
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)
    offset = slot_mapping % page_size
    k_pages = k_pages.at[page, :, offset].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, :, offset].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages
