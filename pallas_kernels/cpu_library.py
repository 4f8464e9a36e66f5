"""The CPU kernels' shared library: every `pallas_kernels/*.cc`, compiled once per machine and registered with
XLA's FFI.

`make serve` / `make test` build it at install time (`python -m pallas_kernels.cpu_library`); otherwise the first
use builds it. It is compiled for the machine it runs on (`-march=native`, as llama.cpp's CPU build is, plus
any flags in `$SLUICE_CXXFLAGS`, e.g. `-mno-avx512vnni` to build the AVX2 path) into
`$SLUICE_HOME/kernels/<key>/`, keyed by the sources, the flags and the machine, so a changed source or another
CPU gets its own build. Without a C++ compiler `available()` is False and callers use the jnp references.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from model.fetch import sluice_home

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cc"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-pthread"]
LIBRARY = "libsluice_cpu.so"


class BuildError(RuntimeError):
    """The C++ compiler is missing or failed."""


def flags() -> list[str]:
    return FLAGS + os.environ.get("SLUICE_CXXFLAGS", "").split()


def library_path() -> Path:
    key = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        key.update(source.read_bytes())
    key.update(" ".join([*flags(), platform.machine(), _cpu_flags(), jax.__version__]).encode())
    return sluice_home() / "kernels" / key.hexdigest()[:16] / LIBRARY


def _cpu_flags() -> str:
    """What -march=native compiles for: the CPU's feature flags (Linux), else the processor name."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        return next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return platform.processor()


def build() -> Path:
    """Compiles the library if this machine has no build of the current sources; returns its path."""
    path = library_path()
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise BuildError("no C++ compiler (g++ or c++) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        output = Path(tmp) / LIBRARY
        command = [compiler, *flags(), f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(output)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{' '.join(command)} failed:\n{result.stderr}")
        output.replace(path)  # atomic: a concurrent build of the same key lands the same bytes
    return path


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, built if needed; None (with a warning) if it cannot be built."""
    try:
        return ctypes.CDLL(str(build()))
    except (BuildError, OSError) as error:
        logger.warning("CPU kernels unavailable, using the jnp references: %s", error)
        return None


@functools.cache
def register(target: str, symbol: str) -> bool:
    """Registers `symbol` of the library as the CPU FFI target `target`; False when the library is unavailable
    or this CPU lacks what its kernels need."""
    library = load()
    if library is None or not library.SluiceCpuSupported():
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


if __name__ == "__main__":  # python -m pallas_kernels.cpu_library: build at install time
    try:
        print(build())
    except BuildError as error:
        print(f"CPU kernels not built ({error}); Sluice will use the jnp references", file=sys.stderr)
