"""Building the CPU kernels (`pallas_kernels/cpu_build.py`, `cpu_library.py`) and what runs without them: the ISA
variant chosen per CPU, a failed build recorded once and not retried, the pure-XLA forms taken without kernels
(and that they are the faster ones there), and the narrower builds this CPU runs (AVX-VNNI, the portable x86-64-v3)
computing what its own build does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sluice.model.linear import Weight, project
from sluice.model.quantize import quantize_params, resolve
from sluice.pallas_kernels import cpu_build, cpu_library
from sluice.pallas_kernels import cpu_qmatmul as cq
from sluice.pallas_kernels.cpu_attention import ragged_paged_attention_cpu
from sluice.pallas_kernels.cpu_build import BASELINE, BuildError
from test_cpu_qmatmul import random_q4, random_q8

ROOT = Path(__file__).resolve().parents[1]
V3_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
AVX512_FLAGS = V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (kernels not yet loaded) with `env` added, tests/ importable."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


# ---- Which variant.

def test_an_avx512_vnni_cpu_tries_its_variant_first_and_keeps_the_baseline_to_fall_back_on(monkeypatch):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(AVX512_FLAGS))
    assert [v.name for v in cpu_build.candidates()] == ["avx512-vnni", "x86-64-v3"]
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(V3_FLAGS))
    assert cpu_build.candidates() == [BASELINE]


def test_sluice_cpu_isa_names_the_variant_to_build(monkeypatch):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(AVX512_FLAGS))
    monkeypatch.setenv("SLUICE_CPU_ISA", "x86-64-v3")
    assert cpu_build.candidates() == [BASELINE]
    monkeypatch.setenv("SLUICE_CPU_ISA", "x86-64-v9")
    with pytest.raises(BuildError, match="not one of avx512-vnni, avx-vnni, x86-64-v3"):
        cpu_build.candidates()


@pytest.mark.parametrize("machine, flags, reason", [
    ("aarch64", None, "no kernel build for aarch64"),
    ("x86_64", frozenset({"sse4_2", "avx"}), "this CPU lacks what the x86-64-v3 build needs: abm, avx2"),
])
def test_a_cpu_without_a_variant_gets_no_kernels_and_a_reason(monkeypatch, machine, flags, reason):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    library, failures = cpu_library.find()
    assert library is None and len(failures) == 1 and failures[0].startswith(reason)


# ---- A failed build, recorded once.

FAKE_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then cat "{folder}/version"; exit 0; fi
echo "$@" >> "{folder}/compiles"
echo "fake-c++: error: cannot compile" >&2
exit 1
"""


def test_a_failed_build_is_recorded_and_retried_only_when_the_compiler_changes(tmp_path, monkeypatch):
    compiler = tmp_path / "fake-c++"
    compiler.write_text(FAKE_COMPILER.format(folder=tmp_path))
    compiler.chmod(0o755)
    (tmp_path / "version").write_text("fake-c++ 1.0\n")
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    compiles = tmp_path / "compiles"

    with pytest.raises(BuildError, match="cannot compile") as first:
        cpu_build.build(BASELINE, cpu_build.find_compiler())
    assert not first.value.earlier and first.value.record.read_text() == str(first.value)
    tried = compiles.read_text()
    assert tried.count("-march=x86-64-v3") == len(cpu_build.SOURCES)

    with pytest.raises(BuildError, match="cannot compile") as second:
        cpu_build.build(BASELINE, cpu_build.find_compiler())
    assert second.value.earlier and second.value.record == first.value.record
    assert compiles.read_text() == tried

    (tmp_path / "version").write_text("fake-c++ 1.1\n")
    with pytest.raises(BuildError) as third:
        cpu_build.build(BASELINE, cpu_build.find_compiler())
    assert not third.value.earlier and third.value.record != first.value.record
    assert len(compiles.read_text()) == 2 * len(tried)


NO_KERNELS = """
from sluice.model.quantize import resolve
from sluice.pallas_kernels.attention import resolve_backend
print(resolve("auto"), resolve("auto"), resolve_backend("auto"), resolve_backend("auto"))
"""


def test_without_a_compiler_auto_takes_float_weights_and_says_why_once_per_start(tmp_path):
    env = {"CXX": str(tmp_path / "no-such-c++"), "SLUICE_HOME": str(tmp_path / "home")}
    first = run_python(NO_KERNELS, **env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.split() == ["none", "none", "reference", "reference"]
    assert first.stderr.count("CPU kernels unavailable") == 1 and "no-such-c++" in first.stderr
    assert first.stderr.count("--quantization auto: float weights") == 1
    assert first.stderr.count("attention backend auto: the jnp reference") == 1
    [record] = (tmp_path / "home" / "kernels").glob("*/FAILED")
    recorded = record.stat().st_mtime_ns

    second = run_python(NO_KERNELS, **env)
    assert second.stdout.split() == ["none", "none", "reference", "reference"]
    assert second.stderr.count("CPU kernels unavailable") == 1 and "at an earlier start" in second.stderr
    assert list((tmp_path / "home" / "kernels").glob("*/FAILED")) == [record]
    assert record.stat().st_mtime_ns == recorded


def test_auto_quantization_is_int4_with_the_kernels_and_float_without():
    assert resolve("auto", "cpu", cpu_kernels=True) == "int4"
    assert resolve("auto", "cpu", cpu_kernels=False) == "none"


# ---- The order of speed without kernels.

def compiled_flops(quantization: str, x: jax.Array) -> float:
    """Flops of one projection by a weight `[576, 1536]` (of a 2-layer stack) in `quantization`, as XLA compiles it
    without the CPU kernels."""
    rng = np.random.default_rng(0)
    params = quantize_params({"w_gate_up": jnp.asarray(rng.standard_normal((2, 576, 1536)) / 24, jnp.float32)},
                             quantization)
    weight = Weight(params["w_gate_up"], params.get("w_gate_up_scale"), params.get("w_gate_up_min"))
    cost = jax.jit(lambda x, w: project(x, w, jnp.int32(1))).lower(x, weight).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_without_kernels_float_weights_cost_fewer_operations_than_dequantized_ones(monkeypatch):
    """Quantized weights without the kernels are unpacked in front of XLA's dot at every call: 2-3x the float
    dot's operations at one row (and 4-8x its time, bench/RESULTS.md), which is why "auto" takes "none" there."""
    monkeypatch.setattr(cq, "available", lambda: False)
    x = jnp.ones((1, 576), jnp.float32)
    float_flops = compiled_flops("none", x)
    assert float_flops == 2 * 576 * 1536
    for quantization in ("int8", "int4"):
        assert compiled_flops(quantization, x) > 1.5 * float_flops


# ---- The narrower builds.

def kernel_outputs() -> dict[str, np.ndarray]:
    """The quantized matmuls and ragged attention (a decode row and a 5-token prefill) on fixed inputs, through
    whichever build this process loaded. 1, 7 and 10 rows end in row tiles of every height the builds have (8-row
    tiles with AVX-512: 1, 7, 8 + 2; 4-row ones without: 1, 4 + 3, 4 + 4 + 2)."""
    rng = np.random.default_rng(0)
    out = {}
    for rows in (1, 7, 10):
        x = rng.standard_normal((rows, 96)).astype(np.float32)
        w, scale = random_q8(rng, 96, 208)
        out[f"q8_{rows}"] = np.asarray(jax.jit(cq.q8_q8)(x, w, scale, 1))
        w, scale, low = random_q4(rng, 96, 208)
        out[f"q4_{rows}"] = np.asarray(jax.jit(cq.q4_q8)(x, w, scale, low, 1))
    q = jnp.asarray(rng.standard_normal((6, 4, 32)), jnp.float32)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((8, 2, 8, 32)), jnp.float32) for _ in range(2))
    page_table = jnp.asarray([[0, 1, 7], [2, 3, 4]], jnp.int32)
    out["attention"] = np.asarray(ragged_paged_attention_cpu(
        q, k_pages, v_pages, jnp.asarray([9, 20], jnp.int32), page_table, jnp.asarray([0, 1, 6], jnp.int32),
        sm_scale=32 ** -0.5))
    return out


VARIANT_OUTPUTS = """
import numpy as np
from sluice.pallas_kernels import cpu_library
import test_kernel_build as t
np.savez("{path}", **t.kernel_outputs())
print(cpu_library.load().variant.name)
"""


@pytest.mark.skipif(not cq.available(), reason="no CPU kernels here (no compiler, or not an x86-64-v3 CPU)")
@pytest.mark.parametrize("variant", cpu_build.VARIANTS[1:], ids=lambda variant: variant.name)
def test_a_narrower_build_computes_what_this_cpus_build_does(tmp_path, variant):
    """The narrower variants are built and run even where a wider one is chosen (an AVX-512 machine): their AVX2
    paths (VNNI's vpdpbusd on 256-bit registers, or vpmaddubsw in its place; 4-row tiles) must give this build's
    numbers."""
    if variant == cpu_library.load().variant or not variant.needs <= (cpu_build.cpu_flags() or set()):
        pytest.skip(f"the {variant.name} build is this CPU's own, or one it cannot run")
    result = run_python(VARIANT_OUTPUTS.format(path=tmp_path / "outputs.npz"), SLUICE_CPU_ISA=variant.name,
                        SLUICE_HOME=str(tmp_path / "home"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [variant.name]
    theirs = np.load(tmp_path / "outputs.npz")
    for name, here in kernel_outputs().items():
        np.testing.assert_allclose(theirs[name], here, rtol=1e-5, atol=1e-5 * np.abs(here).max(), err_msg=name)
