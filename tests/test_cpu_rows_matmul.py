"""The row-independent float32 matmul CPU kernel (`pallas_kernels/cpu_rows_matmul.cc`): against its jnp reference
over shapes that end in partial tiles, a row's bits the same whatever rows share its call, in a layer scan, and the
narrower builds (the AVX2 path, and the portable one through SIMDe) computing what this CPU's build does."""

from __future__ import annotations

import ctypes
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sluice.pallas_kernels import cpu_build, cpu_library
from sluice.pallas_kernels import cpu_rows_matmul as rm
from sluice.pallas_kernels.cpu_build import BASELINE, PORTABLE

needs_kernel = pytest.mark.skipif(not rm.available(), reason="no CPU kernels here (see pallas_kernels/cpu_library.py)")
# (T, K, N, count): one element; tails of rows, vectors and tiles; LoRA's shapes (x @ A of 2 slots, h @ B); no K.
SHAPES = ((1, 1, 1, 1), (5, 37, 83, 2), (9, 576, 24, 2), (13, 16, 1536, 1), (6, 0, 20, 1))
STACK = 4
matmul = jax.jit(rm.rows_matmul, static_argnames="count")


def random_stack(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    return rng.standard_normal((STACK, k, n)).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("rows, k, n, count", SHAPES)
def test_kernel_matches_reference(rows, k, n, count):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((rows, k)).astype(np.float32), random_stack(rng, k, n)
    for first in (0, STACK - count):
        want = np.asarray(rm.rows_matmul_ref(x, w, first, count))
        np.testing.assert_allclose(np.asarray(matmul(x, w, first, count=count)), want, rtol=1e-5,
                                   atol=1e-5 * max(np.abs(want).max(initial=0.0), 1.0))


@needs_kernel
def test_no_rows_give_an_empty_product():
    w = random_stack(np.random.default_rng(2), 8, 20)
    assert matmul(np.zeros((0, 8), np.float32), w, 1, count=3).shape == (0, 3, 20)


@needs_kernel
@pytest.mark.parametrize("rows", (2, 7, 8, 64, 300))
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(rows):
    rng = np.random.default_rng(rows)
    w = random_stack(rng, 576, 72)
    x = (rng.standard_normal((rows, 576)) * rng.uniform(0.1, 10.0, (rows, 1))).astype(np.float32)
    together = np.asarray(matmul(x, w, 1, count=2))
    for row in {0, rows // 2, rows - 1}:
        np.testing.assert_array_equal(np.asarray(matmul(x[row:row + 1], w, 1, count=2))[0], together[row])


@needs_kernel
def test_a_scan_over_layers_multiplies_each_layers_matrices_in_place():
    """As `lora_delta` calls it: a stack [L * S, K, N] of S slots per layer, indexed by the scan's layer."""
    rng = np.random.default_rng(3)
    slots, x, w = 2, rng.standard_normal((5, 64)).astype(np.float32), random_stack(rng, 64, 40)

    def run(x, w):
        def layer(carry, index):
            return carry, rm.rows_matmul(x, w, index * slots + 1, 1)[:, 0]
        return jax.lax.scan(layer, 0, jnp.arange(STACK // slots, dtype=jnp.int32))[1]

    got = np.asarray(jax.jit(run)(x, w))
    np.testing.assert_allclose(got, np.stack([x @ w[1], x @ w[3]]), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_matrices_past_the_stack_are_an_error_not_a_read_past_it():
    w = random_stack(np.random.default_rng(4), 8, 16)
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(matmul(np.ones((1, 8), np.float32), w, STACK - 1, count=2))


def loaded_build(variant: cpu_build.Variant) -> Callable[..., jax.Array]:
    """`rows_matmul` through `variant`'s build (into $SLUICE_HOME), loaded beside this process's own under an FFI
    target of its own."""
    library = ctypes.CDLL(str(cpu_build.build(variant, cpu_build.find_compiler())))
    target = f"sluice_rows_matmul_{variant.name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.SluiceRowsMatmul), platform="cpu")

    def matmul(x: jax.Array, w: jax.Array, first: int, count: int) -> jax.Array:
        out = jax.ShapeDtypeStruct((x.shape[0], count, w.shape[2]), jnp.float32)
        return jax.ffi.ffi_call(target, out)(x, w, jnp.int32(first))
    return jax.jit(matmul, static_argnames="count")


@needs_kernel
@pytest.mark.parametrize("variant", [BASELINE, PORTABLE], ids=lambda variant: variant.name)
def test_a_narrower_build_computes_what_this_cpus_build_does(tmp_path, monkeypatch, variant):
    """The AVX2 path (8-column vectors, 2 per tile, masked loads at the tails) sums in the order the AVX-512 one
    does, with the same fused multiply-adds: the same bits. The portable build on x86 (SIMDe's plain C) multiplies,
    then adds: the same order, but for rounding. (The AVX-VNNI build compiles the baseline's path.)"""
    if variant == cpu_library.load().variant or not variant.needs <= (cpu_build.cpu_flags() or set()):
        pytest.skip(f"the {variant.name} build is this CPU's own, or one it cannot run")
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_CXXFLAGS", raising=False)
    theirs = loaded_build(variant)
    rng = np.random.default_rng(0)
    for rows, k, n, count in SHAPES:
        x, w = rng.standard_normal((rows, k)).astype(np.float32), random_stack(rng, k, n)
        here, there = np.asarray(matmul(x, w, 1, count=count)), np.asarray(theirs(x, w, 1, count=count))
        if variant.simde:
            np.testing.assert_allclose(there, here, rtol=0, atol=1e-5 * max(np.abs(here).max(initial=0.0), 1.0))
        else:
            np.testing.assert_array_equal(there, here)
