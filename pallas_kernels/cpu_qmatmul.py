"""Quantized matmuls on the CPU: the C++ kernels of `cpu_qmatmul.cc` (through `jax.ffi`) beside their jnp
references, and the packed weight layouts they read.

Weights are GGUF's block formats: one scale (Q8_0), or one scale and one min (Q4_1), per BLOCK consecutive
inputs of each output column. The kernels quantize the float32 activations the way llama.cpp does, per row in
blocks of BLOCK inputs (`quantize_activations`), and multiply in integers (AVX-512 VNNI where the CPU has it);
the references compute the same function with the activations fake-quantized and one float32 XLA dot.

Packed layouts, for one weight `[K, *N]` (`pack_q8` / `pack_q4` make them): the output columns, flattened,
come in panels of PANEL whose weights are contiguous over all of K (one sequential read per panel), the
last output axis split as `(N_last / PANEL, PANEL)`; within a panel one 64-byte lane holds 4 (q8) or 8 (q4)
consecutive inputs of each of its columns, a VNNI operand as it is. Column n = PANEL * p + c:
- q8: values int8 `[*N_outer, N_last/16, K/4, 16, 4]`, byte (p, j, c, i) = q[4j + i, n]; scale f16
  `[*N_outer, N_last/16, K/BLOCK, 16]`: `w[k, n] = q[k, n] * scale[p, k // BLOCK, c]`.
- q4: values uint8 `[*N_outer, N_last/16, K/8, 16, 4]`, byte (p, j, c, i) = q[8j + i, n] | q[8j + 4 + i, n] << 4;
  scale and min like q8's scale: `w[k, n] = q[k, n] * scale[p, k // BLOCK, c] + min[p, k // BLOCK, c]`, q in
  [0, 15].
The kernels take `[L, P, K/pack, 16, 4]` (L stacked layers, P = N / 16 panels: the packed axes flattened) and a
layer index, so a layer scan never slices. x: `[M, K]` f32; y: `[M, N]` f32.

A kernel can also normalize its rows first (RMSNorm with a per-layer weight `[L, K]`): in one fixed order per
row, so that a row's numbers never depend on the rows beside it (see `cpu_qmatmul.cc`).

The library is built with the other CPU kernels (`cpu_library.py`); where it cannot be built or the CPU lacks
AVX2/FMA/F16C, `available()` is False and callers use the references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sluice.pallas_kernels import cpu_library

BLOCK = 32
"""Inputs per weight scale (and min), and per activation scale."""
PANEL = 16
"""Output columns whose packed weights are contiguous over K."""
_TARGETS = {"sluice_q8_q8": "SluiceQ8Q8", "sluice_q4_q8": "SluiceQ4Q8"}


def available() -> bool:
    """Whether the kernels run here (registering their FFI targets the first time)."""
    return jax.default_backend() == "cpu" and all(
        cpu_library.register(target, symbol) for target, symbol in _TARGETS.items()
    )


def _out(x: jax.Array, w: jax.Array) -> jax.ShapeDtypeStruct:
    if not available():
        raise RuntimeError("the CPU kernel library is not built or not supported here (see cpu_library.py)")
    return jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * PANEL), jnp.float32)


def _norm(norm: jax.Array | None, w: jax.Array, k: int) -> jax.Array:
    """The RMSNorm weights as the kernels take them: [L, K], or [L, 0] for none."""
    return jnp.zeros((w.shape[0], 0), jnp.float32) if norm is None else norm.astype(jnp.float32).reshape(w.shape[0], k)


def _rows(rows: jax.Array | int | None, x: jax.Array) -> jax.Array:
    return jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32)


def q8_q8(x: jax.Array, w: jax.Array, scale: jax.Array, layer: jax.Array, norm: jax.Array | None = None,
          eps: float = 0.0, rows: jax.Array | int | None = None) -> jax.Array:
    """x [M, K] f32, w int8 [L, P, K/4, 16, 4], scale f16 [L, P, K/32, 16], layer int32 [] -> [M, 16 P] f32.
    With `norm` [L, K], x's rows are RMS-normalized (by norm[layer], with `eps`) first. `rows` (int32 [],
    default M): only x's first `rows` rows are multiplied; the others' outputs are zeros, at no cost."""
    call = jax.ffi.ffi_call("sluice_q8_q8", _out(x, w))
    return call(x, w, scale, jnp.asarray(layer, jnp.int32), _rows(rows, x), _norm(norm, w, x.shape[1]),
                eps=np.float32(eps))


def q4_q8(x: jax.Array, w: jax.Array, scale: jax.Array, min: jax.Array, layer: jax.Array,
          norm: jax.Array | None = None, eps: float = 0.0, rows: jax.Array | int | None = None) -> jax.Array:
    """x [M, K] f32, w uint8 [L, P, K/8, 16, 4], scale/min f16 [L, P, K/32, 16], layer int32 [] -> [M, 16 P] f32.
    `norm`, `eps` and `rows` as in `q8_q8`."""
    call = jax.ffi.ffi_call("sluice_q4_q8", _out(x, w))
    return call(x, w, scale, min, jnp.asarray(layer, jnp.int32), _rows(rows, x), _norm(norm, w, x.shape[1]),
                eps=np.float32(eps))


# ---- References and layouts.

def inverse_rms(x: jax.Array, eps: float) -> jax.Array:
    """x [M, K] float32 -> [M, 1] float32, 1 / sqrt(mean(x^2) + eps)."""
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [M, K] -> x / sqrt(mean(x^2) + eps) * weight, in float32."""
    x = x.astype(jnp.float32)
    return x * inverse_rms(x, eps) * weight.astype(jnp.float32)


def quantize_activations(x: jax.Array) -> jax.Array:
    """x [M, K] f32 -> the values the kernels compute with: per row and block of BLOCK inputs,
    round(x * 127 / max|x|) * max|x| / 127 (round half to even)."""
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    return (jnp.round(blocks * inv) * (amax / 127.0)).reshape(m, k)


def _panels(a: jax.Array, group: int) -> jax.Array:
    """[K, *N] -> [*N_outer, N_last / PANEL, K / group, PANEL, group]."""
    k, *outer, last = a.shape
    a = a.reshape(k // group, group, *outer, last // PANEL, PANEL)
    n = len(outer) + 1
    return jnp.transpose(a, (*range(2, 2 + n), 0, 2 + n, 1))


def _unpanel(a: jax.Array) -> jax.Array:
    """The inverse of `_panels`: [*N_outer, P, K / group, PANEL, group] -> [K, *N_outer, P * PANEL]."""
    *outer, p, kg, panel, group = a.shape
    n = len(outer) + 1
    a = jnp.transpose(a, (n, n + 2, *range(n), n + 1))  # [K/group, group, *outer, P, PANEL]
    return a.reshape(kg * group, *outer, p * panel)


def pack_scales(scale: jax.Array) -> jax.Array:
    """Per-block scales or mins [K/BLOCK, *N] -> [*N_outer, N_last/16, K/BLOCK, 16]."""
    return _panels(scale, 1)[..., 0]


def unpack_scales(scale: jax.Array) -> jax.Array:
    """The inverse of `pack_scales`."""
    return _unpanel(scale[..., None])


def pack_q8(q: jax.Array) -> jax.Array:
    """int8 values [K, *N] -> the q8 layout."""
    return _panels(q, 4)


def pack_q4(q: jax.Array) -> jax.Array:
    """4-bit values in uint8 [K, *N] -> the q4 layout."""
    octets = q.reshape(q.shape[0] // 8, 2, 4, *q.shape[1:])
    return _panels((octets[:, 0] | (octets[:, 1] << 4)).reshape(-1, *q.shape[1:]), 4)


def unpack_q8(values: jax.Array) -> jax.Array:
    """The q8 layout -> int8 values [K, *N]."""
    return _unpanel(values)


def unpack_q4(values: jax.Array) -> jax.Array:
    """The q4 layout -> 4-bit values in uint8 [K, *N]."""
    packed = _unpanel(values)  # [K/2, *N]: row 4j + i holds inputs 8j + i (low) and 8j + 4 + i (high)
    quads = packed.reshape(-1, 4, *packed.shape[1:])
    return jnp.concatenate([quads & 0xF, quads >> 4], axis=1).reshape(-1, *packed.shape[1:])


def dequantize_q8(values: jax.Array, scale: jax.Array) -> jax.Array:
    """One q8 weight (packed values and scales) -> [K, *N] f32."""
    return unpack_q8(values).astype(jnp.float32) * _per_block(unpack_scales(scale))


def dequantize_q4(values: jax.Array, scale: jax.Array, min: jax.Array) -> jax.Array:
    """One q4 weight (packed values, scales and mins) -> [K, *N] f32."""
    return unpack_q4(values).astype(jnp.float32) * _per_block(unpack_scales(scale)) + _per_block(unpack_scales(min))


def _per_block(a: jax.Array) -> jax.Array:
    """[K/BLOCK, *N] -> [K, *N] f32, each block's value repeated over its inputs."""
    return jnp.repeat(a.astype(jnp.float32), BLOCK, axis=0)


def _activations_ref(x: jax.Array, layer: jax.Array, norm: jax.Array | None, eps: float) -> jax.Array:
    return quantize_activations(x if norm is None else rms_norm(x, norm[layer], eps))


def _leading_rows(y: jax.Array, rows: jax.Array | int | None) -> jax.Array:
    """y with its rows from `rows` on zeroed (the kernels' padding rows)."""
    return y if rows is None else jnp.where(jnp.arange(y.shape[0])[:, None] < rows, y, 0.0)


def q8_q8_ref(x: jax.Array, w: jax.Array, scale: jax.Array, layer: jax.Array, norm: jax.Array | None = None,
              eps: float = 0.0, rows: jax.Array | int | None = None) -> jax.Array:
    """The jnp reference of `q8_q8` (kernel-shaped arguments)."""
    weight = dequantize_q8(w[layer], scale[layer])
    return _leading_rows(jnp.dot(_activations_ref(x, layer, norm, eps), weight, precision="highest"), rows)


def q4_q8_ref(x: jax.Array, w: jax.Array, scale: jax.Array, min: jax.Array, layer: jax.Array,
              norm: jax.Array | None = None, eps: float = 0.0, rows: jax.Array | int | None = None) -> jax.Array:
    """The jnp reference of `q4_q8` (kernel-shaped arguments)."""
    weight = dequantize_q4(w[layer], scale[layer], min[layer])
    return _leading_rows(jnp.dot(_activations_ref(x, layer, norm, eps), weight, precision="highest"), rows)
