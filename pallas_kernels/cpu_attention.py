"""Ragged paged attention on the CPU through the C++ kernel in `cpu_attention.cc` (XLA FFI custom call).

The CPU serving path's kernel: same semantics as `ragged_paged_attention` in `attention.py` and as its jnp
reference (`paged_attention_ref.py`), against which the tests check it. It reads each sequence's K/V pages in
place, once per (sequence, kv head) for the whole GQA group, with no gathered copy of the context. An int8 pool
(`kv_cache.QuantizedPages`) is read as it is, each row times its scale as it is loaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sluice.pallas_kernels import cpu_library
from sluice.pallas_kernels.kv_cache import Pages, QuantizedPages

_TARGETS = {
    "sluice_cpu_ragged_paged_attention_f32": "SluiceCpuRaggedPagedAttentionF32",
    "sluice_cpu_ragged_paged_attention_int8": "SluiceCpuRaggedPagedAttentionInt8",
}
_F32_TARGET, _INT8_TARGET = _TARGETS


def available() -> bool:
    return jax.default_backend() == "cpu" and all(
        cpu_library.register(target, symbol) for target, symbol in _TARGETS.items()
    )


def _pool_args(k_pages: Pages, v_pages: Pages) -> tuple[str, tuple[jax.Array, ...]]:
    """The FFI target for the pool's dtype and its pool operands: (k, v) in float32, or int8 (k, k_scales, v,
    v_scales)."""
    if isinstance(k_pages, QuantizedPages):
        return _INT8_TARGET, (k_pages.values, k_pages.scales, v_pages.values, v_pages.scales)
    return _F32_TARGET, (k_pages.astype(jnp.float32), v_pages.astype(jnp.float32))


def ragged_paged_attention_cpu(
    q: jax.Array,
    k_pages: Pages,
    v_pages: Pages,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    *,
    sm_scale: float,
) -> jax.Array:
    """q: [num_tokens, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, num_kv_heads, page_size, head_dim]
    (arrays, or `QuantizedPages` with float32 scales [num_pages, num_kv_heads, page_size]); kv_lens: [num_seqs]
    int32; page_table: [num_seqs, max_pages] int32; cu_q_lens: [num_seqs + 1] int32.
    Returns [num_tokens, num_q_heads, head_dim] in q's dtype (computed in float32)."""
    if not available():
        raise RuntimeError("the CPU attention kernel is not built (see pallas_kernels/cpu_library.py)")
    target, pools = _pool_args(k_pages, v_pages)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), *pools, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32), sm_scale=np.float32(sm_scale),
    )
    return out.astype(q.dtype)
