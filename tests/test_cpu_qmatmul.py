"""The quantized-matmul CPU kernels (`pallas_kernels/cpu_qmatmul.cc`) against their jnp references, over row
counts that exercise every row tile (4, 2, 1) and shapes with one or many panels, and their packed layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sluice.pallas_kernels import cpu_qmatmul as cq

needs_kernels = pytest.mark.skipif(not cq.available(), reason="no CPU kernels here (see pallas_kernels/cpu_library.py)")
ROWS = (1, 2, 3, 4, 6, 7, 16, 37)
SHAPES = ((64, 16), (96, 208), (576, 960))  # (K, N): one panel, an odd number of panels, a model shape
LAYERS = 3


def random_q8(rng: np.random.Generator, k: int, n: int) -> tuple[jax.Array, jax.Array]:
    """A stack of LAYERS random Q8_0 weights [K, N], packed: values and scales."""
    q = rng.integers(-127, 128, (LAYERS, k, n)).astype(np.int8)
    scale = rng.uniform(0.001, 0.01, (LAYERS, k // cq.BLOCK, n)).astype(np.float16)
    return jax.vmap(cq.pack_q8)(q), jax.vmap(cq.pack_scales)(scale)


def random_q4(rng: np.random.Generator, k: int, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A stack of LAYERS random Q4_1 weights [K, N], packed: values, scales and mins."""
    q = rng.integers(0, 16, (LAYERS, k, n)).astype(np.uint8)
    scale = rng.uniform(0.001, 0.01, (LAYERS, k // cq.BLOCK, n)).astype(np.float16)
    low = rng.uniform(-0.08, 0.0, (LAYERS, k // cq.BLOCK, n)).astype(np.float16)
    return jax.vmap(cq.pack_q4)(q), jax.vmap(cq.pack_scales)(scale), jax.vmap(cq.pack_scales)(low)


def assert_close(got, want):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_q8_kernel_matches_reference(rows, k, n):
    rng = np.random.default_rng(1)
    w, scale = random_q8(rng, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for layer in (0, LAYERS - 1):
        assert_close(jax.jit(cq.q8_q8)(x, w, scale, layer), cq.q8_q8_ref(x, w, scale, layer))


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", SHAPES)
def test_q4_kernel_matches_reference(rows, k, n):
    rng = np.random.default_rng(2)
    w, scale, low = random_q4(rng, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for layer in (0, LAYERS - 1):
        assert_close(jax.jit(cq.q4_q8)(x, w, scale, low, layer), cq.q4_q8_ref(x, w, scale, low, layer))


@needs_kernels
@pytest.mark.parametrize("sign", (1, -1))
def test_q4_blocks_at_the_largest_products_sum_exactly(sign):
    # Every nibble 15 against activations all at +-127: a block's int16 partial sums at their largest (30,480
    # without VNNI, where they widen to int32 once a block). An overflow would flip the sign of whole outputs.
    k, n = 576, 96
    q = np.full((LAYERS, k, n), 15, np.uint8)
    scale = np.full((LAYERS, k // cq.BLOCK, n), 0.01, np.float16)
    low = np.zeros((LAYERS, k // cq.BLOCK, n), np.float16)
    w, scale, low = jax.vmap(cq.pack_q4)(q), jax.vmap(cq.pack_scales)(scale), jax.vmap(cq.pack_scales)(low)
    x = np.full((5, k), 3.0 * sign, np.float32)
    got = np.asarray(jax.jit(cq.q4_q8)(x, w, scale, low, 0))
    assert_close(got, cq.q4_q8_ref(x, w, scale, low, 0))
    np.testing.assert_allclose(got, sign * 3.0 * 15 * 0.01 * k, rtol=1e-3)


@needs_kernels
@pytest.mark.parametrize("rows", (1, 5))
def test_rms_norm_in_the_kernel_matches_the_reference_to_within_rounding(rows):
    rng = np.random.default_rng(8)
    w, scale, low = random_q4(rng, 576, 96)
    norm = rng.uniform(0.5, 1.5, (LAYERS, 576)).astype(np.float32)
    x = (rng.standard_normal((rows, 576)) * 7).astype(np.float32)
    got = jax.jit(cq.q4_q8, static_argnames="eps")(x, w, scale, low, 1, norm, eps=1e-5)
    want = np.asarray(cq.q4_q8_ref(x, w, scale, low, 1, norm, 1e-5))
    # XLA's mean of squares may differ from the kernel's by an ulp, which can move an activation across a
    # rounding boundary of its block: a few quantization steps, not more.
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-3 * np.abs(want).max())


@needs_kernels
@pytest.mark.parametrize("kernel", ["q8", "q4"])
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(kernel):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((37, 576)) * 5).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, (LAYERS, 576)).astype(np.float32)
    if kernel == "q8":
        w, scale = random_q8(rng, 576, 96)
        call = jax.jit(lambda x: cq.q8_q8(x, w, scale, 1, norm, 1e-5))
    else:
        w, scale, low = random_q4(rng, 576, 96)
        call = jax.jit(lambda x: cq.q4_q8(x, w, scale, low, 1, norm, 1e-5))
    together = np.asarray(call(x))
    for row in (0, 17, 36):
        np.testing.assert_array_equal(np.asarray(call(x[row:row + 1]))[0], together[row])


@needs_kernels
@pytest.mark.parametrize("kernel", ["q8", "q4"])
def test_only_the_leading_rows_are_multiplied_and_the_padding_rows_are_zeros(kernel):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((13, 96)).astype(np.float32)
    x[9:] = np.nan  # padding rows are never read
    weights = random_q8(rng, 96, 48) if kernel == "q8" else random_q4(rng, 96, 48)
    call = jax.jit(cq.q8_q8 if kernel == "q8" else cq.q4_q8)
    reference = cq.q8_q8_ref if kernel == "q8" else cq.q4_q8_ref
    full = np.asarray(call(x[:9], *weights, 2))
    for rows in (0, 1, 9):
        got = np.asarray(call(x, *weights, 2, rows=jnp.int32(rows)))
        np.testing.assert_array_equal(got[:rows], full[:rows])
        assert np.all(got[rows:] == 0)
        np.testing.assert_array_equal(np.asarray(reference(np.nan_to_num(x), *weights, 2, rows=rows))[rows:], 0)


@needs_kernels
def test_rows_of_zeros_and_of_one_outlier_are_quantized_without_nan():
    rng = np.random.default_rng(3)
    w, scale, low = random_q4(rng, 64, 16)
    x = np.zeros((3, 64), np.float32)
    x[1, 5] = 1e4  # one block of row 1 is all rounding error but its outlier
    got = np.asarray(jax.jit(cq.q4_q8)(x, w, scale, low, 0))
    assert np.isfinite(got).all() and np.all(got[0] == 0) and np.all(got[2] == 0)
    assert_close(got, cq.q4_q8_ref(x, w, scale, low, 0))


def test_activations_keep_within_half_a_step_of_their_block():
    x = np.random.default_rng(4).standard_normal((5, 96)).astype(np.float32)
    step = np.abs(x).reshape(5, 3, cq.BLOCK).max(-1, keepdims=True) / 127
    error = np.abs(np.asarray(cq.quantize_activations(jnp.asarray(x))) - x).reshape(5, 3, cq.BLOCK)
    assert np.all(error <= step * (0.5 + 1e-5))


@pytest.mark.parametrize("pack, unpack, values", [
    (cq.pack_q8, cq.unpack_q8, lambda rng, shape: rng.integers(-127, 128, shape).astype(np.int8)),
    (cq.pack_q4, cq.unpack_q4, lambda rng, shape: rng.integers(0, 16, shape).astype(np.uint8)),
])
def test_packed_layouts_round_trip_over_several_output_axes(pack, unpack, values):
    q = values(np.random.default_rng(5), (64, 3, 32))
    packed = pack(jnp.asarray(q))
    assert packed.shape[:3] == (3, 2, 64 // (8 if pack is cq.pack_q4 else 4)) and packed.shape[3:] == (16, 4)
    np.testing.assert_array_equal(np.asarray(unpack(packed)), q)
    scales = np.random.default_rng(6).standard_normal((2, 3, 32)).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(cq.unpack_scales(cq.pack_scales(jnp.asarray(scales)))), scales)


@needs_kernels
def test_layer_index_out_of_range_is_an_error_not_a_read_past_the_stack():
    w, scale = random_q8(np.random.default_rng(7), 64, 16)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(jax.jit(cq.q8_q8)(x, w, scale, LAYERS))
