"""write_kv: new tokens' K/V land in their slots, padding writes no page a page table holds, and the pool is updated
in place; an int8 pool stores each row quantized with its own scale."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sluice.pallas_kernels.kv_cache import QuantizedPages, dequantize, empty_pages, kv_cache_dtype, row_bytes, write_kv

NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM = 6, 3, 4, 8


def random_pool(rng, dtype=jnp.float32, num_pages=NUM_PAGES):
    shape = (num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    return jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype)


def expected_pool(pool, new, slots):
    out = np.array(pool.astype(jnp.float32))
    for token, slot in enumerate(slots):
        if slot >= 0:
            out[slot // PAGE_SIZE, :, slot % PAGE_SIZE] = np.asarray(jnp.asarray(new[token], pool.dtype).astype(jnp.float32))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_token_lands_in_its_slot_and_padding_writes_nothing(dtype):
    rng = np.random.default_rng(0)
    k_pages, v_pages = random_pool(rng, dtype)
    # Slots across pages and offsets, last slot of the pool, and padding tokens.
    slots = np.array([0, 5, -1, 7, 8, NUM_PAGES * PAGE_SIZE - 1, -1, 13], np.int32)
    k = rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    want_k, want_v = expected_pool(k_pages, k, slots), expected_pool(v_pages, v, slots)

    k_pages, v_pages = write_kv(k_pages, v_pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))

    assert k_pages.dtype == dtype and v_pages.dtype == dtype
    np.testing.assert_array_equal(np.asarray(k_pages.astype(jnp.float32)), want_k)
    np.testing.assert_array_equal(np.asarray(v_pages.astype(jnp.float32)), want_v)


@pytest.mark.parametrize("slot", [0, 13, NUM_PAGES * PAGE_SIZE - 1, -1])
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
def test_a_lone_token_lands_in_its_slot_and_a_lone_padding_token_in_the_pools_last_slot_alone(slot, kv_dtype):
    """One token (a one-row decode step) is written by a dynamic-update-slice, which has no write to drop: its
    padding goes to the pool's last slot, in the null page a model's pool keeps out of every page table."""
    rng = np.random.default_rng(5)
    pools = (int8_pool(rng), int8_pool(rng)) if kv_dtype == jnp.int8 else random_pool(rng, kv_dtype)
    read = lambda pages: np.array(dequantize(pages) if kv_dtype == jnp.int8 else pages.astype(jnp.float32))
    befores = [read(pages) for pages in pools]
    k = rng.standard_normal((1, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)

    written = write_kv(*pools, jnp.asarray(k), jnp.asarray(-k), jnp.asarray([slot], jnp.int32))

    landed = slot % (NUM_PAGES * PAGE_SIZE)
    for pages, before, row in zip(written, befores, (k[0], -k[0])):
        after = read(pages)
        written = after[landed // PAGE_SIZE, :, landed % PAGE_SIZE]
        np.testing.assert_allclose(written, row, atol=np.abs(row).max() / 127 if kv_dtype == jnp.int8 else 0.01)
        after[landed // PAGE_SIZE, :, landed % PAGE_SIZE] = before[landed // PAGE_SIZE, :, landed % PAGE_SIZE]
        np.testing.assert_array_equal(after, before)


def test_standalone_write_reuses_the_donated_pool_buffers():
    rng = np.random.default_rng(1)
    k_pages, v_pages = random_pool(rng, num_pages=64)
    k = jnp.asarray(rng.standard_normal((3, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    slots = jnp.asarray([3, -1, 200], jnp.int32)
    compiled = write_kv.lower(k_pages, v_pages, k, k, slots).compile().as_text()
    assert "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }" in compiled
    pointers = (k_pages.unsafe_buffer_pointer(), v_pages.unsafe_buffer_pointer())

    new_k, new_v = write_kv(k_pages, v_pages, k, k, slots)

    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
    assert k_pages.is_deleted() and v_pages.is_deleted()


def test_write_inside_a_layer_scan_over_the_folded_pool_touches_only_that_layer():
    """How the model uses it: all layers in one donated array, folded to one flat page pool."""
    num_layers, num_tokens = 3, 5
    rng = np.random.default_rng(2)
    shape = (num_layers, NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k_cache = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    new = jnp.asarray(rng.standard_normal((num_layers, num_tokens, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    slots = jnp.asarray([2, 9, -1, 17, 23], jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_cache, v_cache, new, slots):
        flat = lambda c: c.reshape(num_layers * NUM_PAGES, *c.shape[2:])

        def layer(carry, xs):
            k_pool, v_pool = carry
            layer_idx, kv = xs
            layer_slots = jnp.where(slots < 0, slots, slots + layer_idx * NUM_PAGES * PAGE_SIZE)
            return write_kv(k_pool, v_pool, kv, -kv, layer_slots), None

        (k_pool, v_pool), _ = jax.lax.scan(layer, (flat(k_cache), flat(v_cache)), (jnp.arange(num_layers), new))
        return k_pool.reshape(shape), v_pool.reshape(shape)

    want_k = np.stack([expected_pool(k_cache[l], new[l], np.asarray(slots)) for l in range(num_layers)])
    want_v = np.stack([expected_pool(v_cache[l], -new[l], np.asarray(slots)) for l in range(num_layers)])
    compiled = step.lower(k_cache, v_cache, new, slots).compile().as_text()
    pointer = k_cache.unsafe_buffer_pointer()

    k_cache, v_cache = step(k_cache, v_cache, new, slots)

    np.testing.assert_array_equal(np.asarray(k_cache), want_k)
    np.testing.assert_array_equal(np.asarray(v_cache), want_v)
    assert "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }" in compiled
    assert k_cache.unsafe_buffer_pointer() == pointer


def int8_pool(rng) -> QuantizedPages:
    shape = (NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    return QuantizedPages(jnp.asarray(rng.integers(-127, 128, shape), jnp.int8),
                          jnp.asarray(rng.uniform(0.01, 0.1, shape[:-1]), jnp.float32))


def test_int8_write_stores_each_row_within_half_its_step_and_a_zero_row_as_zeros():
    rng = np.random.default_rng(3)
    k_pages, v_pages = int8_pool(rng), int8_pool(rng)
    before = jax.tree.map(np.asarray, (k_pages, v_pages))
    slots = np.array([0, 5, -1, 7, 13, NUM_PAGES * PAGE_SIZE - 1], np.int32)
    k = rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) * [[1], [30], [0.01]]
    k[4, 1] = 0.0
    v = -k

    k_pages, v_pages = write_kv(k_pages, v_pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))

    for pages, x, old in ((k_pages, k, before[0]), (v_pages, v, before[1])):
        assert pages.values.dtype == jnp.int8 and pages.scales.dtype == jnp.float32
        written = [s for s in slots if s >= 0]
        page, offset = np.array(written) // PAGE_SIZE, np.array(written) % PAGE_SIZE
        rows = x[slots >= 0]
        scales = np.asarray(pages.scales)[page, :, offset]  # [tokens, heads]
        np.testing.assert_allclose(scales, np.abs(rows).max(-1) / 127, rtol=1e-6)
        back = np.asarray(dequantize(pages))[page, :, offset]
        assert np.all(np.abs(back - rows) <= scales[..., None] / 2 * (1 + 1e-5))
        assert np.abs(np.asarray(pages.values)[page, :, offset]).max() == 127
        assert scales[3, 1] == 0 and not np.asarray(pages.values)[page[3], 1, offset[3]].any()
        untouched = np.ones((NUM_PAGES, PAGE_SIZE), bool)
        untouched[page, offset] = False
        np.testing.assert_array_equal(np.asarray(pages.values).transpose(0, 2, 1, 3)[untouched],
                                      old.values.transpose(0, 2, 1, 3)[untouched])
        np.testing.assert_array_equal(np.asarray(pages.scales).transpose(0, 2, 1)[untouched],
                                      old.scales.transpose(0, 2, 1)[untouched])


def test_standalone_int8_write_reuses_the_donated_values_and_scales():
    rng = np.random.default_rng(4)
    k_pages, v_pages = int8_pool(rng), int8_pool(rng)
    k = jnp.asarray(rng.standard_normal((3, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((k_pages, v_pages))]

    new = write_kv(k_pages, v_pages, k, k, jnp.asarray([3, -1, 20], jnp.int32))

    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(new)] == pointers


def test_an_empty_int8_pool_reads_back_as_zeros_and_counts_its_scales_in_its_bytes():
    pages = empty_pages((2, NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM), jnp.int8)
    assert pages.scales.shape == (2, NUM_PAGES, NUM_KV_HEADS, PAGE_SIZE)
    assert not np.asarray(dequantize(pages)).any()
    assert row_bytes(HEAD_DIM, jnp.int8) == HEAD_DIM + 4 and row_bytes(HEAD_DIM, jnp.bfloat16) == 2 * HEAD_DIM


@pytest.mark.parametrize(("choice", "activation", "backend", "pool"), [
    ("auto", "bfloat16", "gpu", "bfloat16"), ("auto", "float16", "gpu", "float16"),
    ("auto", "bfloat16", "cpu", "float32"), ("auto", "float32", "cpu", "float32"), ("int8", "bfloat16", "cpu", "int8"),
])
def test_a_cpus_pool_is_float32_where_a_gpus_keeps_the_activation_dtype(choice, activation, backend, pool):
    """XLA:CPU writes rows into a 16-bit float array by converting all of it to float32 and back (a pass over the
    whole pool per layer and step), so a CPU's pool is float32."""
    assert kv_cache_dtype(choice, activation, backend) == jnp.dtype(pool)
