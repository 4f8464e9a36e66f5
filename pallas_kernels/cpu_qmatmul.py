"""Quantized-weight matmuls on the CPU: the C++ kernels of `cpu_qmatmul.cc` (through `jax.ffi`) beside their
jnp references.

The kernels widen int8 / 4-bit weights to float32 in registers and multiply float32 activations
(weight-only quantization), multithreaded over the cores. XLA's own dots cannot do that at batch 1: a convert
before the dot is materialized (a float32 copy of the weights every step), and its int8 x int8 dots need
quantized activations and are slow for a handful of rows (bench/quant.py measures every form).

Layouts (`L` stacked layers; the kernels take the whole stack and a layer index, so a layer scan never slices):
- q8_kn: w int8 `[L, K, N]`, scale f32 `[L, N]`: `y = (x @ w[layer]) * scale[layer]`.
- q8_nk: w int8 `[N, K]`, scale f32 `[N]`: `y = (x @ w.T) * scale` (an embedding table as the LM head).
- q4_kn: w uint8 `[L, K/2, N]` (byte (j, n) holds k = 2j in its low nibble, k = 2j + 1 in its high one),
  gscale, gmin f16 `[L, K/32, N]`: `w[k, n] = q * gscale[k // 32, n] + gmin[k // 32, n]`.
x: `[M, K]` f32; y: `[M, N]` f32.

The library is built with the other CPU kernels (`cpu_library.py`); where it cannot be built or the CPU lacks
AVX2/FMA/F16C, `available()` is False and callers use the references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_library

GROUP = 32
"""q4 weights share one scale and one min per GROUP consecutive input features."""
_TARGETS = {"sluice_q8_kn": "SluiceQ8Kn", "sluice_q8_nk": "SluiceQ8Nk", "sluice_q4_kn": "SluiceQ4Kn"}


def available() -> bool:
    """Whether the kernels run here (registering their FFI targets the first time)."""
    return all(cpu_library.register(target, symbol) for target, symbol in _TARGETS.items())


def _out(x: jax.Array, n: int) -> jax.ShapeDtypeStruct:
    if not available():
        raise RuntimeError("the CPU kernel library is not built or not supported here (see cpu_library.py)")
    return jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)


def q8_kn(x: jax.Array, w: jax.Array, scale: jax.Array, layer: jax.Array) -> jax.Array:
    """x [M, K] f32, w int8 [L, K, N], scale [L, N] f32, layer int32 [] -> [M, N] f32."""
    return jax.ffi.ffi_call("sluice_q8_kn", _out(x, w.shape[2]))(x, w, scale, jnp.asarray(layer, jnp.int32))


def q8_nk(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x [M, K] f32, w int8 [N, K], scale [N] f32 -> [M, N] f32."""
    return jax.ffi.ffi_call("sluice_q8_nk", _out(x, w.shape[0]))(x, w, scale)


def q4_kn(x: jax.Array, w: jax.Array, gscale: jax.Array, gmin: jax.Array, layer: jax.Array) -> jax.Array:
    """x [M, K] f32, w uint8 [L, K/2, N], gscale/gmin f16 [L, K/32, N], layer int32 [] -> [M, N] f32."""
    return jax.ffi.ffi_call("sluice_q4_kn", _out(x, w.shape[2]))(x, w, gscale, gmin, jnp.asarray(layer, jnp.int32))


def q8_kn_ref(x: jax.Array, w: jax.Array, scale: jax.Array, layer: jax.Array) -> jax.Array:
    """The jnp reference of `q8_kn`: the weights widened to f32, then one XLA dot."""
    return jnp.dot(x, w[layer].astype(jnp.float32), preferred_element_type=jnp.float32) * scale[layer]


def q8_nk_ref(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """The jnp reference of `q8_nk`."""
    return jnp.dot(x, w.T.astype(jnp.float32), preferred_element_type=jnp.float32) * scale


def unpack_q4(w: jax.Array, gscale: jax.Array, gmin: jax.Array) -> jax.Array:
    """w uint8 [K/2, N], gscale/gmin f16 [K/32, N] -> the weights [K, N] f32."""
    half, n = w.shape
    q = jnp.stack([w & 0xF, w >> 4], axis=1).reshape(-1, GROUP, n).astype(jnp.float32)
    return (q * gscale.astype(jnp.float32)[:, None] + gmin.astype(jnp.float32)[:, None]).reshape(2 * half, n)


def q4_kn_ref(x: jax.Array, w: jax.Array, gscale: jax.Array, gmin: jax.Array, layer: jax.Array) -> jax.Array:
    """The jnp reference of `q4_kn`: unpack one layer to f32, then one XLA dot."""
    return jnp.dot(x, unpack_q4(w[layer], gscale[layer], gmin[layer]), preferred_element_type=jnp.float32)
