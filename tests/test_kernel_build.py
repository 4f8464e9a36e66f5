"""Building the CPU kernels (`pallas_kernels/cpu_build.py`, `cpu_library.py`) and what runs without them: the ISA
variant chosen per CPU, a failed build recorded once and not retried, the pure-XLA forms taken without kernels
(and that they are the faster ones there), and the narrower builds this CPU runs (AVX-VNNI, the x86-64-v3 baseline,
the portable build through SIMDe) computing what its own build does."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
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
from sluice.pallas_kernels.cpu_build import BASELINE, PORTABLE, BuildError
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
    monkeypatch.setenv("SLUICE_CPU_ISA", "portable")
    assert cpu_build.candidates() == [PORTABLE]
    monkeypatch.setenv("SLUICE_CPU_ISA", "x86-64-v9")
    with pytest.raises(BuildError, match="not one of avx512-vnni, avx-vnni, x86-64-v3, portable"):
        cpu_build.candidates()


def test_an_x86_cpu_without_avx2_gets_no_kernels_and_a_reason(monkeypatch):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    library, failures = cpu_library.find()
    assert library is None and failures == [
        "this CPU lacks what the x86-64-v3 build needs: abm, avx2, bmi1, bmi2, f16c, fma, movbe"]


def not_installed(name: str):
    raise importlib.metadata.PackageNotFoundError(name)


@pytest.mark.parametrize("machine", ["arm64", "aarch64"])  # macOS's name for ARM64, and Linux's
def test_a_cpu_other_than_x86_builds_the_portable_variant_which_needs_simde(tmp_path, monkeypatch, machine):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: None)  # macOS has no /proc/cpuinfo
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    assert cpu_build.candidates() == [PORTABLE]

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_build.importlib.metadata, "distribution", not_installed)
    library, failures = cpu_library.find()
    assert library is None and failures == ["the portable build failed: the portable build needs SIMDe's headers: "
                                             "pip install cmeel-simde"]


def test_the_portable_build_failed_for_want_of_simde_is_tried_again_once_simde_is_installed(monkeypatch):
    compiler = cpu_build.find_compiler()
    with_simde = cpu_build.build_folder(PORTABLE, compiler)
    assert f"-I{cpu_build.simde_include()}" in cpu_build.flags(PORTABLE)
    monkeypatch.setattr(cpu_build.importlib.metadata, "distribution", not_installed)
    assert cpu_build.build_folder(PORTABLE, compiler) != with_simde


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

def exact_inputs(rng: np.random.Generator, rows: int) -> tuple[np.ndarray, *tuple[jax.Array, ...]]:
    """x [rows, 96], a Q8_0 weight and a Q4_1 one [96, 208] (values, scale, Q4_1's values, min) on which every float
    step of the quantized matmuls is exact: each block of x holds +-127 (scale 1: x is quantized as it is) and
    halves (which round to even), the weights' scales are 1 and their mins integers."""
    x = rng.integers(-253, 254, (rows, 96)) / 2
    x[:, ::32] = 127.0 * rng.choice([-1, 1], (rows, 3))
    q8 = cq.pack_q8(jnp.asarray(rng.integers(-127, 128, (96, 208)), jnp.int8))
    q4 = cq.pack_q4(jnp.asarray(rng.integers(0, 16, (96, 208)), jnp.uint8))
    ones = cq.pack_scales(jnp.ones((3, 208), jnp.float16))
    low = cq.pack_scales(jnp.asarray(rng.integers(-8, 1, (3, 208)), jnp.float16))
    return x.astype(np.float32), q8[None], ones[None], q4[None], low[None]


def kernel_outputs() -> dict[str, np.ndarray]:
    """The quantized matmuls and ragged attention (a decode row and a 5-token prefill) on fixed inputs, through
    whichever build this process loaded; those named `exact_*` on inputs where no float step rounds. 1, 7 and 10
    rows end in row tiles of every height the builds have (8-row tiles with AVX-512: 1, 7, 8 + 2; 4-row ones
    without: 1, 4 + 3, 4 + 4 + 2)."""
    rng = np.random.default_rng(0)
    out = {}
    for rows in (1, 7, 10):
        x, q8, ones, q4, low = exact_inputs(rng, rows)
        out[f"exact_q8_{rows}"] = np.asarray(jax.jit(cq.q8_q8)(x, q8, ones, 0))
        out[f"exact_q4_{rows}"] = np.asarray(jax.jit(cq.q4_q8)(x, q4, ones, low, 0))
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
@pytest.mark.parametrize("variant", [*cpu_build.VARIANTS[1:], PORTABLE], ids=lambda variant: variant.name)
def test_a_narrower_build_computes_what_this_cpus_build_does(tmp_path, variant):
    """The narrower variants are built and run even where a wider one is chosen (an AVX-512 machine): their AVX2
    paths (VNNI's vpdpbusd on 256-bit registers, or vpmaddubsw in its place; 4-row tiles), and the same paths
    through SIMDe (its plain-C forms on x86), must give this build's numbers: exactly where no float step rounds
    (the activations' quantization and the integer dot products), else but for rounding. That differs in the last
    bits: without VNNI, Q8_0's -128 offset is not taken off per block; the portable build on x86 multiplies, then
    adds, where the others fuse (one more rounding per FMA). Up to 1.6e-7 of the largest output on these inputs."""
    if variant == cpu_library.load().variant or not variant.needs <= (cpu_build.cpu_flags() or set()):
        pytest.skip(f"the {variant.name} build is this CPU's own, or one it cannot run")
    result = run_python(VARIANT_OUTPUTS.format(path=tmp_path / "outputs.npz"), SLUICE_CPU_ISA=variant.name,
                        SLUICE_HOME=str(tmp_path / "home"), SLUICE_CXXFLAGS="")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [variant.name]
    theirs = np.load(tmp_path / "outputs.npz")
    for name, here in kernel_outputs().items():
        if name.startswith("exact_"):
            np.testing.assert_array_equal(theirs[name], here, err_msg=name)
        else:
            np.testing.assert_allclose(theirs[name], here, rtol=0, atol=1e-6 * np.abs(here).max(), err_msg=name)


@pytest.mark.skipif(platform.machine().lower() not in cpu_build.X86 or shutil.which("objdump") is None,
                    reason="an x86 machine's build, read by objdump")
def test_the_portable_build_on_x86_uses_no_avx_instruction(tmp_path, monkeypatch):
    """SIMDe's plain-C forms at the compiler's default target (x86-64: SSE2): no VEX-encoded instruction (their
    mnemonics begin with v), no 256- or 512-bit register."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_CXXFLAGS", raising=False)
    library = cpu_build.build(PORTABLE, cpu_build.find_compiler())
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True).stdout
    avx = re.findall(r"^\s*[0-9a-f]+:\s+(v\w+.*|.*%[yz]mm.*)$", code, re.MULTILINE)
    assert "mulps" in code and avx == []


ARM64_CXX = "aarch64-linux-gnu-g++"


@pytest.mark.skipif(shutil.which(ARM64_CXX) is None,
                    reason=f"no ARM64 cross compiler ({ARM64_CXX}: apt-get install g++-aarch64-linux-gnu)")
def test_an_arm64_machines_build_compiles_here_to_neon(tmp_path, monkeypatch):
    """The build an ARM64 Linux machine makes (its variant, its flags), cross-compiled: the sources hold nothing
    x86-only outside SIMDe, and SIMDe takes NEON there (fused multiply-adds on 128-bit registers, fmla)."""
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "aarch64")
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", ARM64_CXX)
    monkeypatch.delenv("SLUICE_CPU_ISA", raising=False)
    monkeypatch.delenv("SLUICE_CXXFLAGS", raising=False)
    [variant] = cpu_build.candidates()
    library = cpu_build.build(variant, cpu_build.find_compiler())
    code = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(library)], capture_output=True, text=True,
                          check=True).stdout
    assert re.search(r"\tfmla\tv\d+\.4s", code)
