"""Float32 matmuls on the CPU whose rows are independent of each other, bit for bit: the C++ kernel of
`cpu_rows_matmul.cc` (through `jax.ffi`) beside its jnp reference.

XLA's dot sums each output over K in an order that its GEMM kernel and blocking set, and those it picks by the
number of rows: a row's last bits then depend on the rows beside it. The kernel sums every output over K in order,
one fused multiply-add per input, whatever the rows (see `cpu_rows_matmul.cc`), so a token's numbers are those it
gets alone. It takes a stack of matrices `[G, K, N]` whole with the index of the first to multiply, so a layer
scan never slices.

The library is built with the other CPU kernels (`cpu_library.py`); where it cannot be built, `available()` is
False and callers use XLA's dots (`model.llama.lora_delta`), not batch-invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sluice.pallas_kernels import cpu_library

_TARGET, _SYMBOL = "sluice_rows_matmul", "SluiceRowsMatmul"


def available() -> bool:
    """Whether the kernel runs here (registering its FFI target the first time)."""
    return jax.default_backend() == "cpu" and cpu_library.register(_TARGET, _SYMBOL)


def rows_matmul(x: jax.Array, w: jax.Array, first: jax.Array | int, count: int) -> jax.Array:
    """x f32 [T, K], w f32 [G, K, N], first int32 [] -> [T, count, N] f32: row t's product with each of the
    matrices w[first], ..., w[first + count - 1], each row's sums in an order that no other row changes."""
    if not available():
        raise RuntimeError("the CPU kernel library is not built or not supported here (see cpu_library.py)")
    out = jax.ShapeDtypeStruct((x.shape[0], count, w.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out)(x, w, jnp.asarray(first, jnp.int32))


def rows_matmul_ref(x: jax.Array, w: jax.Array, first: jax.Array | int, count: int) -> jax.Array:
    """The jnp reference of `rows_matmul`."""
    matrices = jax.lax.dynamic_slice_in_dim(w, jnp.asarray(first, jnp.int32), count)
    return jnp.einsum("tk,ckn->tcn", x, matrices, precision="highest", preferred_element_type=jnp.float32)
