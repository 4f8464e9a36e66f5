"""Whole KV pages between the device pool and host memory, in batches: what the prefix store (`kv_store.py`) keeps.

The pool (`model.llama.empty_kv_cache`): (k, v), each `[num_layers, num_pages, num_kv_heads, page_size, head_dim]`,
or int8 `QuantizedPages` with scales `[num_layers, num_pages, num_kv_heads, page_size]`. A page's payload
(`kv_store.PagePayload`) is that tree's leaves with the page axis taken out, in `jax.tree.leaves` order.

Batches are padded to a power of two pages, so a handful of compilations serve every count.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sluice.batching.kv_store import PagePayload
from sluice.model.llama import KVCache


@jax.jit
def gather_pages(kv_cache: KVCache, page_ids: jax.Array) -> KVCache:
    """page_ids: [n] int32 -> the pool's tree with leaves `[n, num_layers, ...]` (page-major, so that on the host
    each page is one contiguous block)."""
    return jax.tree.map(lambda x: jnp.moveaxis(x[:, page_ids], 1, 0), kv_cache)


@partial(jax.jit, donate_argnums=(0,))
def scatter_pages(kv_cache: KVCache, page_ids: jax.Array, pages: KVCache) -> KVCache:
    """Writes `pages` (as `gather_pages` returns them: leaves `[n, num_layers, ...]`) into pages `page_ids` ([n]
    int32) of the pool (donated: updated in place) and returns the pool; an out-of-range id writes nothing."""
    return jax.tree.map(lambda x, p: x.at[:, page_ids].set(jnp.moveaxis(p, 0, 1), mode="drop"), kv_cache, pages)


def _padded(page_ids: Sequence[int], fill: int) -> np.ndarray:
    """`page_ids` (non-empty) then `fill` up to a power of two: [2^k] int32."""
    ids = np.full(1 << (len(page_ids) - 1).bit_length(), fill, np.int32)
    ids[:len(page_ids)] = page_ids
    return ids


class PageCopy:
    """Pages `page_ids` (non-empty) on their way out of the pool: gathered on the device at once (after the steps
    already dispatched), copied to the host without blocking; `payloads` waits for them."""

    def __init__(self, kv_cache: KVCache, page_ids: Sequence[int]):
        ids = _padded(page_ids, 0)  # the padding gathers page 0, never returned
        self._leaves = jax.tree.leaves(gather_pages(kv_cache, ids))
        self._count = len(page_ids)
        for leaf in self._leaves:
            leaf.copy_to_host_async()

    def payloads(self) -> list[PagePayload]:
        leaves = [np.asarray(leaf) for leaf in self._leaves]
        # Each page copied out, so a page the store keeps holds its own bytes, not the whole batch's.
        return [tuple(np.array(leaf[i]) for leaf in leaves) for i in range(self._count)]


def load_pages(kv_cache: KVCache, page_ids: Sequence[int], payloads: Sequence[PagePayload]) -> KVCache:
    """Writes `payloads[i]` into page `page_ids[i]` (non-empty, one payload each) of the pool (donated) and
    returns the updated pool."""
    leaves, treedef = jax.tree.flatten(kv_cache)
    ids = _padded(page_ids, leaves[0].shape[1])  # num_pages: out of range, so the padding writes nothing
    stacked = [np.zeros((len(ids), *first.shape), first.dtype) for first in payloads[0]]
    for i, payload in enumerate(payloads):
        for leaf, array in zip(stacked, payload, strict=True):
            leaf[i] = array
    return scatter_pages(kv_cache, ids, jax.tree.unflatten(treedef, stacked))
