"""The step-bytes audit (`bench/step_audit.py`): what it finds in the engine's compiled decode step, and that each
of its checks fires on a small program built to fail it."""

from __future__ import annotations

import dataclasses

import functools
import math
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import pytest

from sluice.bench.step_audit import StoredArray, StepAudit, abstract_runner, audit, audit_decode_call, \
    audit_decode_step, audit_mixed_step, compile_decode_step, host_syncs, launches, parse_hlo, pool_copy, \
    step_kernels, target_device
from sluice.bench.engine_check import MODELS
from sluice.model.config import ModelConfig
from sluice.pallas_kernels import cpu_qmatmul

# Small, with dims that no two weights (nor the pool, nor an activation) share, so every array is named by its
# shape alone: per layer wqkv [96, 160], wo [96, 96], w_gate_up [96, 640], w_down [320, 96].
CONFIG = ModelConfig.tiny(vocab_size=1008, num_layers=3, hidden_size=96, intermediate_size=320, num_heads=6,
                          num_kv_heads=2, head_dim=16)
LAYER_PROJECTIONS = {"wqkv[layer] x3", "wo[layer] x3", "w_gate_up[layer] x3", "w_down[layer] x3"}
ISSUE = "issue 25, item 3 (weights read once per step); remove this mark when it passes"
ROWS, K = 8, 256
S = jax.ShapeDtypeStruct


def audited(fn, args: tuple, weights: Sequence[StoredArray], pool: Sequence[StoredArray] = (),
            donate: tuple[int, ...] = ()) -> StepAudit:
    """`fn` jitted and compiled on `args` (shapes), audited against a floor of its weights and pool read once."""
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return audit(fn.__name__, compiled, weights, sum(a.nbytes for a in [*weights, *pool]), pool)


def stored(name: str, shape: tuple[int, ...], dtype=jnp.float32, stacked: bool = False) -> StoredArray:
    return StoredArray(name, shape, math.prod(shape) * jnp.dtype(dtype).itemsize, stacked)


# --- The engine's decode step ------------------------------------------------------------------------------

@functools.cache
def decode_step(dtype: str, quantization: str = "none", layer_loop: str = "scan") -> StepAudit:
    return audit_decode_step(CONFIG, dtype, rows=ROWS, quantization=quantization, layer_loop=layer_loop)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_multiplies_each_fused_projection_once_per_layer(dtype):
    step = decode_step(dtype)
    # The untied LM head [96, 1008] has the embedding's shape transposed.
    assert set(step.projections) == LAYER_PROJECTIONS | {"lm_head or embed"}, step.projections
    assert step.unfused == ()


@pytest.mark.skipif(not cpu_qmatmul.available(), reason="the CPU's quantized matmul kernels are not built")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_decode_step_reads_weights_in_place(quantization):
    step = decode_step("float32", quantization)
    assert step.clean, step.findings()
    assert {"wqkv x3", "wo x3", "w_gate_up x3", "w_down x3"} <= set(step.projections), step.projections


@pytest.mark.xfail(strict=True, reason="under a scan, model.linear.project slices each layer's float weights out of "
                                       "their stack and XLA copies the slice at every layer: the CPU's default loop for "
                                       "its compile time (its default, quantized, weights are read in place), not the "
                                       "GPU's (--layer-loop auto unrolls there); remove this mark when it passes")
def test_scanned_decode_step_reads_float_weights_in_place():
    step = decode_step("float32")
    assert step.copies == (), step.copies


def test_unrolled_decode_step_reads_float_weights_in_place_once_per_layer():
    step = decode_step("float32", layer_loop="unrolled")
    assert step.copies == (), step.copies
    layers = CONFIG.num_layers
    assert Counter(step.projections) == {"wqkv[layer]": layers, "wo[layer]": layers, "w_gate_up[layer]": layers,
                                         "w_down[layer]": layers, "lm_head or embed": 1}, step.projections
    assert "unrolled" in step.label


@pytest.mark.xfail(strict=True, reason=f"XLA's CPU compiler converts the bf16 weight stacks to f32 at every step, "
                                       f"and the CPU attention kernel (f32 only) the whole bf16 pool at every layer; "
                                       f"{ISSUE}")
def test_decode_step_keeps_bf16_weights_and_pool_in_bf16():
    step = decode_step("bfloat16")
    assert step.upcasts == (), step.upcasts


def test_the_multi_step_decode_call_has_no_host_sync_when_the_host_decides_the_samplers_branches():
    assert audit_decode_call(CONFIG, "float32", num_steps=4, rows=ROWS, sampler_branches="host").syncs == []


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_the_multi_step_decode_call_updates_the_pool_in_place(layer_loop):
    call = audit_decode_call(CONFIG, "float32", num_steps=4, rows=ROWS, layer_loop=layer_loop)
    assert call.pool_copy == [], call.pool_copy


def test_the_sampler_branches_the_device_decides_are_host_syncs_at_every_step_of_the_call():
    # The CPU's choice (a conditional costs nothing there): the skip of the steps after every row ended, and the
    # sampler's penalties, sampling and top-logprob branches (with filters and draft checks inside sampling).
    syncs = audit_decode_call(CONFIG, "float32", num_steps=4, rows=ROWS, sampler_branches="device").syncs
    assert len(syncs) >= 4 and all("4x per call: conditional" in f for f in syncs), syncs


# --- Each check fails what it is for -------------------------------------------------------------------------

def test_a_donated_pool_whose_update_a_loop_reads_before_it_is_copied():
    # openxla/xla#45912's pattern: the update's input is read again (here by a loop) after the update, so XLA keeps
    # both and the donated buffer cannot take the update in place.
    def update_then_read(pool, x):
        updated = pool.at[0].set(x[0])
        return jax.lax.fori_loop(0, 4, lambda i, acc: acc + pool[i], updated)

    args = (S((72, K), jnp.float32), S((ROWS, K), jnp.float32))
    compiled = jax.jit(update_then_read, donate_argnums=0).lower(*args).compile()
    assert len(pool_copy(compiled, 72 * K * 4)) == 1
    in_place = jax.jit(lambda pool, x: pool.at[0].set(x[0]), donate_argnums=0).lower(*args).compile()
    assert pool_copy(in_place, 72 * K * 4) == []


def test_conditionals_and_while_loops_of_unknown_trip_count_are_host_syncs():
    def branches_in_a_scan(ws, x, n):
        def step(x, w):
            # Branches unlike enough that XLA keeps the conditional (not a select of both).
            return jax.lax.cond(jnp.sum(x) > 0, lambda x: jnp.tanh(x @ w), lambda x: x * 2.0, x), None

        x = jax.lax.scan(step, x, ws)[0]
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.sin(c[1] @ ws[0])), (0, x))[1]

    args = (S((4, K, K), jnp.float32), S((ROWS, K), jnp.float32), S((), jnp.int32))
    syncs = host_syncs(parse_hlo(jax.jit(branches_in_a_scan).lower(*args).compile().as_text()))
    assert len(syncs) == 2, syncs
    assert any("4x per call: conditional" in f for f in syncs), syncs
    assert any(f.endswith("while, at every iteration") for f in syncs), syncs


def test_a_scan_is_no_host_sync():
    def scan_only(ws, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    args = (S((4, K, K), jnp.float32), S((ROWS, K), jnp.float32))
    assert host_syncs(parse_hlo(jax.jit(scan_only).lower(*args).compile().as_text())) == []


def test_a_loops_kernels_count_at_every_trip():
    def layers(ws, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w) * 2.0, None), x, ws)[0]

    def count(num_layers: int) -> int:
        args = (S((num_layers, K, K), jnp.float32), S((ROWS, K), jnp.float32))
        return launches(parse_hlo(jax.jit(layers).lower(*args).compile().as_text()))

    two, four, eight = count(2), count(4), count(8)
    assert eight - four == 2 * (four - two) > 0, (two, four, eight)


def test_weights_read_in_place_pass_at_about_the_floor():
    def separate_layers(w0, w1, w2, w3, x):
        for w in (w0, w1, w2, w3):
            x = jnp.tanh(x @ w)
        return x

    weights = [stored(f"w{i}", (K, K)) for i in range(4)]
    result = audited(separate_layers, (*(S((K, K), jnp.float32) for _ in weights), S((ROWS, K), jnp.float32)),
                     weights)
    assert result.clean, result.findings()
    assert result.ratio < 1.5


def test_a_layer_sliced_from_stacked_weights_in_a_scan_is_a_copy():
    def scan_over_stack(ws, x):
        return jax.lax.scan(lambda x, i: (jnp.tanh(x @ ws[i]), None), x, jnp.arange(4))[0]

    result = audited(scan_over_stack, (S((4, K, K), jnp.float32), S((ROWS, K), jnp.float32)),
                     [stored("w", (4, K, K), stacked=True)])
    assert len(result.copies) == 1 and "a copy of w[layer]" in result.copies[0] and "4x per step" in result.copies[0]
    assert result.projections == ("w[layer] x4",)
    assert result.ratio > 2.5, "each layer read, written and read again"


def test_bf16_weights_converted_to_f32_are_an_upcast():
    def f32_matmul(w, x):
        return x @ w.astype(jnp.float32)

    result = audited(f32_matmul, (S((K, K), jnp.bfloat16), S((ROWS, K), jnp.float32)),
                     [stored("w", (K, K), jnp.bfloat16)])
    assert len(result.upcasts) == 1 and "convert bf16[256, 256] -> f32, w" in result.upcasts[0]


def test_separate_q_k_v_matmuls_of_one_input_are_unfused():
    def separate_qkv(wq, wk, wv, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
        return h @ wq, h @ wk, h @ wv

    shapes = {"wq": (K, K), "wk": (K, 64), "wv": (K, 32)}
    result = audited(separate_qkv, (*(S(s, jnp.float32) for s in shapes.values()), S((ROWS, K), jnp.float32)),
                     [stored(name, shape) for name, shape in shapes.items()])
    assert len(result.unfused) == 1 and "3 matmuls of one input" in result.unfused[0], result.unfused
    assert all(name in result.unfused[0] for name in shapes)


def test_one_fused_qkv_matmul_is_not_unfused():
    def fused_qkv(wqkv, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True))
        return jnp.split(h @ wqkv, [K, K + 64], axis=-1)

    result = audited(fused_qkv, (S((K, K + 96), jnp.float32), S((ROWS, K), jnp.float32)),
                     [stored("wqkv", (K, K + 96))])
    assert result.projections == ("wqkv",) and result.clean, result.findings()


@pytest.mark.parametrize("donated", [True, False])
def test_a_pool_update_is_a_copy_unless_done_in_place(donated):
    def write_rows(pool, rows, x):
        return pool.at[rows].set(x)

    result = audited(write_rows, (S((72, K), jnp.float32), S((ROWS,), jnp.int32), S((ROWS, K), jnp.float32)),
                     [], [stored("pool", (72, K))], donate=(0,) if donated else ())
    assert bool(result.copies) != donated, result.copies


def test_a_kernels_bytes_count_an_in_place_updates_rows_and_a_gathers_rows_not_the_whole_buffer():
    def update_then_gather(pool, rows, x):
        pool = pool.at[rows].set(x)
        return pool, pool[rows + 1] * 2.0

    args = (S((72, K), jnp.float32), S((ROWS,), jnp.int32), S((ROWS, K), jnp.float32))
    kernels = step_kernels(parse_hlo(jax.jit(update_then_gather, donate_argnums=0).lower(*args).compile().as_text()))
    row_bytes, index_bytes = ROWS * K * 4, ROWS * 4
    scatter = [k for k in kernels if k.op_class == "copy" and k.type == f"f32[72, {K}]"]
    assert [k.nbytes for k in scatter] == [2 * row_bytes + index_bytes], kernels  # rows read and written, indices
    gather = [k for k in kernels if k.type == f"f32[{ROWS}, {K}]"]
    assert len(gather) == 1 and gather[0].nbytes <= 2 * row_bytes + 2 * index_bytes, kernels


# --- XLA:GPU's step, compiled without a GPU ------------------------------------------------------------------

# As CONFIG, with heads of 64 (the Mosaic kernel's least) and a wider hidden size.
GPU_CONFIG = ModelConfig.tiny(vocab_size=1008, num_layers=3, hidden_size=192, intermediate_size=320, num_heads=4,
                              num_kv_heads=2, head_dim=64)


def h100():
    """The abstract H100 the audit compiles for, or a skip where jax's CUDA plugin is missing (`make
    check-gpu-image` installs it)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="jax's CUDA plugin (make check-gpu-image installs it)")
    try:
        return target_device("h100")
    except SystemExit as error:
        pytest.fail(str(error))


def test_the_gpus_bf16_decode_step_reads_weights_and_pool_in_place_in_bf16():
    step = audit_decode_step(GPU_CONFIG, "bfloat16", rows=ROWS, device=h100())
    assert step.clean, step.findings()
    assert "unrolled" in step.label and step.cost_bytes is None
    assert {"wo[layer]", "w_gate_up[layer]", "w_down[layer]"} <= set(step.projections), step.projections
    assert step.launches >= 5 * GPU_CONFIG.num_layers  # a layer's four matmuls and its attention, at the least


def test_the_gpus_multi_step_decode_call_has_no_host_sync_and_updates_the_pool_in_place():
    call = audit_decode_call(GPU_CONFIG, "bfloat16", num_steps=4, rows=ROWS, device=h100())
    assert call.syncs == [] and call.pool_copy == [], (call.syncs, call.pool_copy)


def test_the_gpus_int8_decode_step_reads_its_int8_weights_in_place():
    """The GPU's int8 weights are per output channel (`model.quantize`): XLA:GPU fuses their conversion into the
    matmuls: each matmul reads its stored weight, and no float copy of one is made. (It once looked for the CPU
    kernels' FFI targets on CUDA, and GGUF's blocks were dequantized into a copy per layer.)"""
    # An MLP width of whole 128-wide tiles: XLA:GPU pads an int8 contracting axis of 320 into a converted copy.
    config = dataclasses.replace(GPU_CONFIG, intermediate_size=640)
    step = audit_decode_step(config, "bfloat16", rows=ROWS, quantization="int8", device=h100())
    assert "int8" in step.label
    assert step.clean, step.findings()
    assert {"wqkv[layer]", "wo[layer]", "w_gate_up[layer]", "w_down[layer]"} <= set(step.projections), step.projections


def test_the_gpus_one_row_decode_step_normalizes_each_projections_input_in_one_kernel():
    """A norm before a projection, x / rms(x) * g, was two kernels at one row: the mean of squares written out
    as a lone scalar, read back by an elementwise pass (a kernel launch of about 3 us at C=1 on the H200, 63 of
    the 8B's 561 a step). As (x * g @ W) / rms(x), one kernel computes x * g and the mean of squares (the LM
    head's x * g goes into its matmul, and its mean of squares stays a scalar of its own)."""
    device = h100()
    runner = abstract_runner(MIXED_CONFIG, "bfloat16", 1, K, device=device)
    kernels = step_kernels(parse_hlo(compile_decode_step(runner, 1, device=device).as_text()))
    scalars = [k for k in kernels if k.type == "f32[]"]
    assert [k for k in kernels if k.op_class == "matmul"] and len(scalars) <= 1, scalars


def test_the_gpus_one_row_decode_step_writes_k_and_v_without_reading_the_rows_they_replace():
    """XLA makes a one-row scatter into the pool a dynamic-update-slice that first reads the row it replaces (to
    keep it where the write is dropped), a kernel of its own in each layer of a one-row step; a dynamic-update-slice
    written as one, its padding sent to the null page, reads nothing of the pool."""
    device = h100()
    c = MIXED_CONFIG
    runner = abstract_runner(c, "bfloat16", 1, K, device=device)
    kernels = step_kernels(parse_hlo(compile_decode_step(runner, 1, device=device).as_text()))
    row_reads = [k for k in kernels if k.type == f"bf16[1, {c.num_kv_heads}, 1, {c.head_dim}]"]
    writes = [k for k in kernels if "dynamic-update-slice" in k.ops]
    assert not row_reads and len(writes) == 2 * c.num_layers, (row_reads, writes)


# A mixed step as the H200's sustained run had them: 1,024 tokens for a server of 1,024 sequences (so 1,024 attention
# rows of up to 16 queries), on two of Llama-3-8B's layers (a smaller model's matmuls are split over K, and XLA fuses
# their partial sums into the kernels that read them). Each attention row's queries go to the Mosaic kernel as a
# padded tile of 64 rows per KV head (16 tokens x a GQA group of 4), 16 times the step's q.
MIXED_CONFIG = dataclasses.replace(MODELS["llama-3-8b"], num_layers=2, vocab_size=1008)
MIXED_TOKENS = 1024


@functools.cache
def mixed_step():
    return audit_mixed_step(MIXED_CONFIG, "bfloat16", MIXED_TOKENS, rows=MIXED_TOKENS, context=K, device=h100())


def test_the_gpus_mixed_step_writes_each_tokens_k_and_v_into_the_pool_in_place():
    step = mixed_step()
    c = MIXED_CONFIG
    assert f"{MIXED_TOKENS} attention rows of up to 16 queries" in step.label and step.pool_copies == ()
    writes = [k for k in step.of_class("copy")
              if "scatter" in k.ops and k.type.endswith(f", {c.num_kv_heads}, 16, {c.head_dim}]")]
    assert sum(k.runs for k in writes) == 2 * c.num_layers, writes
    kv_bytes = MIXED_TOKENS * c.num_kv_heads * c.head_dim * 2
    # Each reads its rows (and positions, slots, rotary angles) and writes them: not the pool.
    assert all(2 * kv_bytes <= k.nbytes < 3 * kv_bytes for k in writes), writes


def test_the_gpus_mixed_step_moves_its_padded_query_tiles_once_per_layer():
    c = MIXED_CONFIG
    tile_bytes = MIXED_TOKENS * c.num_kv_heads * 64 * c.head_dim * 2
    moving_tiles = [k for k in mixed_step().of_class("copy") if k.nbytes >= tile_bytes]
    assert sum(k.runs for k in moving_tiles) == c.num_layers, moving_tiles  # their build
