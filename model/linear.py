"""Linear projections over plain or quantized weights, and the one table that picks how each is multiplied.

A `Weight` is a parameter as stored (`model.quantize` makes the quantized ones):
- float: values `[..., K, *N]` in the model dtype;
- int8: values int8 like the float, scale f32 with the K axis removed (one per output channel);
- int4: values uint8 with K halved (two 4-bit values per byte), scale and min f16 with K divided by 32.
Layer weights are stacked `[num_layers, K, *N]` and indexed by the scan's layer inside `project`.

How it is multiplied (measured on the 2-core CPU, bench/quant.py; see bench/RESULTS.md):
- float weights: XLA's dot.
- quantized on the CPU with at most KERNEL_MAX_ROWS rows (decode steps): the C++ kernels of
  `pallas_kernels/cpu_qmatmul.cc`, which widen the weights in registers and take the whole layer stack, so
  neither a float copy of the weights nor a per-layer slice is ever made.
- quantized otherwise (prefill, large decode batches, other backends, or the kernel library not built): the
  weights widened to the activation dtype in front of XLA's dot, int8 scaled after it (weight-only
  quantization; XLA fuses the convert into its dot). XLA's int8 x int8 -> int32 dot with the rows quantized on the
  fly is faster on the CPU from 8 rows up, but one activation scale per row costs too much quality
  (SmolLM2's top-1 agreement with float32 falls from 97% to 89%), so it is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_qmatmul

KERNEL_MAX_ROWS = 16


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Weight:
    """values: float | int8 | uint8 (int4 pairs); scale, min: None for float weights (min only for int4)."""

    values: jax.Array
    scale: jax.Array | None = None
    min: jax.Array | None = None

    @property
    def format(self) -> str:
        if self.scale is None:
            return "float"
        return "int4" if self.min is not None else "int8"


def _use_kernel(w: Weight, num_rows: int, num_out: int) -> bool:
    return (
        w.format != "float" and num_rows <= KERNEL_MAX_ROWS and num_out % 8 == 0
        and jax.default_backend() == "cpu" and cpu_qmatmul.available()
    )


def project(x: jax.Array, w: Weight, layer: jax.Array | None = None, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x: [T, K] -> [T, *N] in `out_dtype` (default x's). w: stacked `[L, K, *N]` with `layer` an int32 index,
    or `[K, *N]`."""
    if layer is None:
        w = jax.tree.map(lambda a: a[None], w)
        layer = jnp.int32(0)
    out_shape = w.values.shape[2:]
    w = _flatten_outputs(w, math.prod(out_shape))
    if _use_kernel(w, x.shape[0], w.values.shape[2]):
        x32 = x.astype(jnp.float32)
        if w.format == "int8":
            y = cpu_qmatmul.q8_kn(x32, w.values, w.scale, layer)
        else:
            y = cpu_qmatmul.q4_kn(x32, w.values, w.scale, w.min, layer)
    else:
        y = _xla_dot(x, jax.tree.map(lambda a: a[layer], w))
    return y.astype(out_dtype or x.dtype).reshape(x.shape[0], *out_shape)


def _flatten_outputs(w: Weight, num_out: int) -> Weight:
    """[L, K, *N] -> [L, K, prod(N)] (scales alike): free reshapes of contiguous trailing axes."""
    keep = lambda a, axes: None if a is None else a.reshape(*a.shape[:axes], num_out)
    return Weight(keep(w.values, 2), keep(w.scale, 1 if w.format == "int8" else 2), keep(w.min, 2))


def project_rows(x: jax.Array, table: Weight) -> jax.Array:
    """x @ table.T, for an embedding table used as the LM head: x [T, K], table [N, K] -> [T, N] float32."""
    if _use_kernel(table, x.shape[0], table.values.shape[0]) and table.format == "int8":
        return cpu_qmatmul.q8_nk(x.astype(jnp.float32), table.values, table.scale)
    return _xla_dot(x, jax.tree.map(lambda a: a.T, table))


def _xla_dot(x: jax.Array, w: Weight) -> jax.Array:
    """x [T, K] @ one weight [K, N] -> [T, N] float32 through XLA's dot. int8 is converted in front of the dot
    and scaled after it, which lets XLA's CPU backend fuse the convert into its matmul (scaling first would
    materialize a float copy of the weight, 1.5x slower at 64 rows)."""
    if w.format == "int8":
        return jnp.dot(x, w.values.astype(x.dtype), preferred_element_type=jnp.float32) * w.scale
    return jnp.dot(x, dequantize(w, x.dtype), preferred_element_type=jnp.float32)


def dequantize(w: Weight, dtype: jnp.dtype) -> jax.Array:
    """One weight `[K, N]` (scale `[N]`, or int4 scale/min `[K/32, N]`) widened to `dtype`."""
    if w.format == "float":
        return w.values.astype(dtype)
    if w.format == "int8":
        return w.values.astype(dtype) * w.scale.astype(dtype)
    return cpu_qmatmul.unpack_q4(w.values, w.scale, w.min).astype(dtype)


def embed_rows(table: Weight, token_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows of an embedding table `[vocab, hidden]` (float or int8 with one scale per row) -> [T, hidden]."""
    rows = jnp.take(table.values, token_ids, axis=0).astype(dtype)
    if table.format == "float":
        return rows
    return rows * jnp.take(table.scale, token_ids, axis=0)[:, None].astype(dtype)
