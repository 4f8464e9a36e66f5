"""The C++ CPU kernels (`pallas_kernels/cpu_qmatmul.cc`) against their jnp references, over row counts that
exercise every row tile (4, 2, 1) and column counts that exercise every column tile and the tails."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pallas_kernels import cpu_qmatmul as cq

pytestmark = pytest.mark.skipif(
    not cq.available(), reason="the CPU kernel library could not be built, or no AVX2 here"
)
ROWS = (1, 2, 3, 4, 7, 16)
SHAPES = ((64, 136), (96, 200), (576, 960))  # (K, N): N % 64 and N % 32 tails, and a model shape


def random_inputs(rows: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)


def assert_close(got, want):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_int8_stacked_weights_match_reference(rows, k, n):
    rng = np.random.default_rng(1)
    w = rng.integers(-127, 128, (3, k, n)).astype(np.int8)
    scale = rng.uniform(0.001, 0.01, (3, n)).astype(np.float32)
    x = random_inputs(rows, k, 2)
    for layer in (0, 2):
        assert_close(jax.jit(cq.q8_kn)(x, w, scale, layer), cq.q8_kn_ref(x, w, scale, layer))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_int8_row_major_table_matches_reference(rows, k, n):
    rng = np.random.default_rng(3)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scale = rng.uniform(0.001, 0.01, n).astype(np.float32)
    x = random_inputs(rows, k, 4)
    assert_close(jax.jit(cq.q8_nk)(x, w, scale), cq.q8_nk_ref(x, w, scale))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_int4_stacked_weights_match_reference(rows, k, n):
    rng = np.random.default_rng(5)
    w = rng.integers(0, 256, (3, k // 2, n)).astype(np.uint8)
    gscale = rng.uniform(0.001, 0.01, (3, k // cq.GROUP, n)).astype(np.float16)
    gmin = rng.uniform(-0.08, 0.0, (3, k // cq.GROUP, n)).astype(np.float16)
    x = random_inputs(rows, k, 6)
    for layer in (0, 2):
        assert_close(jax.jit(cq.q4_kn)(x, w, gscale, gmin, layer), cq.q4_kn_ref(x, w, gscale, gmin, layer))


def test_layer_index_out_of_range_is_an_error_not_a_read_past_the_stack():
    w = np.zeros((2, 64, 64), np.int8)
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(jax.jit(cq.q8_kn)(random_inputs(1, 64, 0), w, np.ones((2, 64), np.float32), 2))
