"""bench.device_profile: the busy time is the union of kernel intervals, and each kernel lands in its class."""

import time

import jax
import jax.numpy as jnp
import pytest

from sluice.bench.device_profile import DeviceEvent, DeviceTrace, op_class, summarize


def event(start, duration, kernel, hlo_op="fusion.1", program="jit_step"):
    return DeviceEvent(start, duration, kernel, hlo_op, program)


def test_busy_time_counts_overlapping_kernels_once_and_control_flow_not_at_all():
    events = [event(0, 10, "sm90_xmma_gemm_bf16bf16", "custom-call.3"), event(5, 10, "loop_add_fusion"),
              event(30, 5, "ragged_paged_attention", "custom-call.7"), event(0, 40, "while", "while.2")]
    summary = summarize(events, window_ns=(0, 100))
    assert (summary.busy_s, summary.span_s, summary.busy_share) == pytest.approx((40e-9, 100e-9, 0.4))
    assert summary.by_class == pytest.approx(dict(matmul=10e-9, attention=5e-9, copy=0.0, fusion=10e-9, other=0.0))
    per_step = summary.as_dict(steps=2)
    assert per_step["busy_ms"] == pytest.approx(20e-6) and per_step["by_program_ms"]["jit_step"]["matmul"] == 5e-6
    assert [(op["kernel"], op["runs"], op["ms"]) for op in per_step["top_ops"]] == [
        ("sm90_xmma_gemm_bf16bf16", 0.5, 5e-6), ("loop_add_fusion", 0.5, 5e-6), ("ragged_paged_attention", 0.5, 2.5e-6)]


def test_kernels_dispatched_ahead_count_only_their_part_inside_the_window():
    # An engine's call runs on after the host's window closes, and the one before it ran into the window's start.
    events = [event(-30, 40, "sm90_xmma_gemm_bf16bf16", "custom-call.3"), event(20, 30, "loop_add_fusion"),
              event(90, 50, "ragged_paged_attention", "custom-call.7"), event(120, 10, "loop_add_fusion")]
    summary = summarize(events, window_ns=(0, 100))
    assert (summary.busy_s, summary.span_s) == pytest.approx((50e-9, 100e-9))
    assert summary.by_class == pytest.approx(dict(matmul=10e-9, attention=10e-9, copy=0.0, fusion=30e-9, other=0.0))


def test_kernel_names_and_instructions_give_the_class():
    assert op_class("nvjet_tst_128x256", "custom-call.1") == "matmul"
    assert op_class("input_reduce_fusion", "dot.4") == "matmul"
    assert op_class("paged_decode_attention", "custom-call.2") == "attention"
    assert op_class("transpose_copy", "copy.9") == "copy"
    assert op_class("dynamic_update_slice", "dynamic-update-slice.3") == "copy"
    assert op_class("loop_rsqrt_fusion", "fusion.5") == "fusion"
    assert op_class("argmax_kernel", "sort.1") == "other"


def test_a_traced_program_shows_up_with_its_matmul():
    f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(0))
    a = jnp.ones((256, 256)) / 256
    jax.block_until_ready(f(a, a))
    with DeviceTrace() as trace:
        for _ in range(3):
            jax.block_until_ready(f(a, a))
    summary = trace.summary()
    assert 0 < summary.busy_s <= summary.span_s
    assert any("lambda" in program for program in summary.by_program)
    assert sum(summary.by_class.values()) > 0


def test_a_window_measures_only_its_part_of_the_traced_block():
    f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(0))
    a = jnp.ones((256, 256)) / 256
    jax.block_until_ready(f(a, a))
    with DeviceTrace() as trace:
        time.sleep(0.3)  # outside the window: an engine's steps that collect what ran while the tracer started
        with trace.window():
            for _ in range(3):
                jax.block_until_ready(f(a, a))
    summary = trace.summary()
    assert 0 < summary.busy_s <= summary.span_s < 0.3
