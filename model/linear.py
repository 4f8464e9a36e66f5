"""Linear projections over plain or quantized weights, and where each form is multiplied.

A `Weight` is a parameter as stored (`model.quantize` makes the quantized ones):
- float: values `[..., K, *N]` in the model dtype;
- q8 (Q8_0): values int8 in the packed layout, scale f16 (`pallas_kernels/cpu_qmatmul.py`);
- q4 (Q4_1): values uint8 (two 4-bit values per byte) in the packed layout, scale and min f16;
- q8c (int8 per output channel, where the CPU kernels do not run): values int8 in the float form's shape, scale
  float32 in that shape without K (told from q8 by its dtype: GGUF's scales are f16).
Layer weights are stacked on a leading `[num_layers]` axis and indexed by the scan's layer inside `project`.

How they are multiplied (chosen by measurement: bench/quant.py, figures in bench/RESULTS.md):
- float weights: XLA's dot.
- quantized, on a CPU with the kernel library: the C++ kernels, for every row count. They quantize the
  activations per block of 32 (as llama.cpp does) and multiply in integers; they take the whole layer stack,
  so neither a float copy of the weights nor a per-layer slice is ever made.
- q8c: XLA's dot of the int8 values converted to the activations' dtype, scaled per output channel after it
  (XLA:GPU fuses the conversion into the matmul, so the weights are read in place, a byte per parameter).
- q8 and q4 otherwise (an accelerator, or no C++ compiler): the weights dequantized in front of XLA's dot.
A projection may RMS-normalize its input first (`RmsNorm`, the norm in front of a Llama block's q/k/v and MLP
and of its LM head); the CPU kernels do it inside, in an order that no other row of the batch changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from sluice.pallas_kernels import cpu_qmatmul
from sluice.pallas_kernels.cpu_qmatmul import PANEL


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Weight:
    """values: float | int8 (q8, q8c) | uint8 (q4); scale: None for float weights; min: q4 only."""

    values: jax.Array
    scale: jax.Array | None = None
    min: jax.Array | None = None

    @property
    def format(self) -> str:
        if self.scale is None:
            return "float"
        if self.min is not None:
            return "q4"
        return "q8c" if self.scale.dtype == jnp.float32 else "q8"

    def out_shape(self, stacked: bool) -> tuple[int, ...]:
        """The output axes `*N` (the float form's axes after K)."""
        if self.format in ("float", "q8c"):
            return self.values.shape[2 if stacked else 1:]
        *outer, panels = self.scale.shape[1 if stacked else 0:-2]
        return (*outer, panels * PANEL)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RmsNorm:
    """x / sqrt(mean(x^2) + eps) * weight on a projection's input rows; weight `[K]`, or `[L, K]` stacked like
    the projection's weight."""

    weight: jax.Array
    eps: float = field(metadata=dict(static=True))


def layer_slice(stack: jax.Array, layer: jax.Array) -> jax.Array:
    """stack[layer] for a traced int32 `layer` in range: [L, ...] -> [...]. lax's dynamic index, not jnp's
    indexing, which takes 15 times as long to trace, and every bucket's program traces each layer weight's."""
    return jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False)


def arithmetic_dtype(quantization: str, dtype: str) -> str:
    """The dtype the matmuls multiply in, for a resolved `quantization` and activation `dtype`: int8 where the
    CPU kernels run quantized weights (their activations are int8 too), else `dtype` (float weights, or
    quantized ones dequantized in front of XLA's dot)."""
    return "int8" if quantization != "none" and cpu_qmatmul.available() else dtype


def project(x: jax.Array, w: Weight, layer: jax.Array | None = None, out_dtype: jnp.dtype | None = None,
            norm: RmsNorm | None = None, num_real: jax.Array | None = None) -> jax.Array:
    """x: [T, K] -> [T, *N] in `out_dtype` (default x's), x normalized first by `norm` if given. w: stacked
    `[L, ...]` with `layer` an int32 index, or a single weight. `num_real` (int32 [], default T): only x's
    first rows matter; the others' outputs are unspecified (the CPU kernels skip them and give zeros)."""
    out_shape = w.out_shape(stacked=layer is not None)
    if layer is None:
        w, norm = jax.tree.map(lambda a: a[None], (w, norm))
        layer = jnp.int32(0)

    def dot(h: jax.Array, w: Weight, layer: jax.Array) -> jax.Array:
        w = jax.tree.map(lambda a: layer_slice(a, layer), w)
        # Contracted over K with the weight's output axes kept ([K, 2, I] for gate/up): merged by a reshape, a
        # sharded axis among them could not stay split, and tensor parallelism would gather the weight.
        if w.format == "q8c":
            return jnp.tensordot(h, w.values.astype(x.dtype), 1, preferred_element_type=jnp.float32) * w.scale
        weight = w.values if w.format == "float" else dequantize(w, x.dtype)
        return jnp.tensordot(h, weight, 1, preferred_element_type=jnp.float32)

    def normalized_first(x, w, layer, norm) -> jax.Array:
        return dot(cpu_qmatmul.rms_norm(x, layer_slice(norm.weight, layer), norm.eps).astype(x.dtype), w, layer)

    def scaled_after(x, w, layer, norm) -> jax.Array:
        """x / rms(x) * g @ W as (x * g @ W) / rms(x), the row's scale applied by the matmul's consumers: XLA:GPU
        then computes x * g and the mean of squares in one kernel, where the normalized row took two at one row
        (a reduction, then an elementwise pass): a Llama-3-8B decode step of one row went from 561 kernels to 498.
        The matmul's output is rounded to its dtype before it is scaled, as it is without a norm, so that the
        rounding stays in the matmul and its consumers read half float32's bytes. Not on a CPU, where XLA's
        reductions then round differently in a step with LoRA adapters than in one without."""
        x32 = x.astype(jnp.float32)
        row_scale = cpu_qmatmul.inverse_rms(x32, norm.eps)
        y = dot((x32 * layer_slice(norm.weight, layer).astype(jnp.float32)).astype(x.dtype), w, layer)
        return y.astype(out_dtype or x.dtype).astype(jnp.float32) * row_scale.reshape(-1, *[1] * (y.ndim - 1))

    def xla_dot(x, w, layer, norm, num_real) -> jax.Array:
        if norm is None:
            return dot(x, w, layer)
        return jax.lax.platform_dependent(x, w, layer, norm, cpu=normalized_first, default=scaled_after)

    def kernel(x, w, layer, norm, num_real) -> jax.Array:
        return _kernel(x.astype(jnp.float32), w, layer, norm, num_real).reshape(x.shape[0], *out_shape)

    if w.format in ("q8", "q4") and cpu_qmatmul.available():
        # Chosen where the program is lowered, not by this process's default device: a program compiled here for
        # a GPU (`bench.step_audit --target`) takes the dequantizing path.
        y = jax.lax.platform_dependent(x, w, layer, norm, num_real, cpu=kernel, default=xla_dot)
    else:
        y = xla_dot(x, w, layer, norm, num_real)
    return y.astype(out_dtype or x.dtype)


def _kernel(x: jax.Array, w: Weight, layer: jax.Array, norm: RmsNorm | None, rows: jax.Array | None) -> jax.Array:
    """The CPU kernels on the stack flattened to their `[L, P, K/pack, 16, 4]` (free reshapes)."""
    def flat(a: jax.Array, tail: int) -> jax.Array:
        return a.reshape(a.shape[0], -1, *a.shape[-tail:])

    weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
    if w.format == "q8":
        return cpu_qmatmul.q8_q8(x, flat(w.values, 3), flat(w.scale, 2), layer, weight, eps, rows)
    return cpu_qmatmul.q4_q8(x, flat(w.values, 3), flat(w.scale, 2), flat(w.min, 2), layer, weight, eps, rows)


def project_rows(x: jax.Array, table: Weight, norm: RmsNorm | None = None,
                 num_real: jax.Array | None = None) -> jax.Array:
    """x @ table.T for an embedding table used as the LM head: x [T, K] -> [T, vocab] float32, x normalized
    first by `norm` if given, `num_real` as in `project`. A packed table is stored like an `[K, vocab]` weight
    already."""
    if table.format in ("float", "q8c"):
        table = Weight(table.values.T, table.scale)
    return project(x, table, out_dtype=jnp.float32, norm=norm, num_real=num_real)


def dequantize(w: Weight, dtype: jnp.dtype) -> jax.Array:
    """One weight (not stacked) -> `[K, *N]` in `dtype`."""
    if w.format == "float":
        return w.values.astype(dtype)
    if w.format == "q8c":
        return (w.values.astype(jnp.float32) * w.scale).astype(dtype)
    if w.format == "q8":
        return cpu_qmatmul.dequantize_q8(w.values, w.scale).astype(dtype)
    return cpu_qmatmul.dequantize_q4(w.values, w.scale, w.min).astype(dtype)


def embed_rows(table: Weight, token_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows of an embedding table `[vocab, hidden]` (float or q8c, or q8 stored like an `[hidden, vocab]` weight)
    -> [T, hidden]."""
    if table.format == "float":
        return jnp.take(table.values, token_ids, axis=0).astype(dtype)
    if table.format == "q8c":  # a scale per vocabulary row
        rows = jnp.take(table.values, token_ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(table.scale, token_ids)[:, None]).astype(dtype)
    panel, column = token_ids // PANEL, token_ids % PANEL
    values = table.values[panel, :, column, :]  # [T, hidden/4, 4]
    scale = table.scale[panel, :, column]  # [T, hidden/32]
    rows = values.reshape(len(token_ids), -1, cpu_qmatmul.BLOCK).astype(dtype) * scale[..., None].astype(dtype)
    return rows.reshape(len(token_ids), -1)
