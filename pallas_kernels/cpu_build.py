"""Builds the CPU kernel library (`cpu_qmatmul.cc` -> `_cpu_qmatmul.so`) against jaxlib's FFI headers.

    python -m pallas_kernels.cpu_build      # run by the Makefile's install step

Without a C++ compiler it says so and leaves the library unbuilt (Sluice then runs the jnp references);
a compile error fails loudly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax

from pallas_kernels.cpu_qmatmul import LIBRARY

SOURCE = Path(__file__).with_name("cpu_qmatmul.cc")
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx2", "-mfma", "-mf16c"]


def build(output: Path = LIBRARY) -> bool:
    """Compiles the library into `output`; False when no compiler is found."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print(f"warning: no C++ compiler; {output.name} not built, the CPU runs the jnp references", file=sys.stderr)
        return False
    tmp = output.with_suffix(f".tmp{os.getpid()}.so")
    cmd = [compiler, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", str(tmp)]
    subprocess.run(cmd, check=True)
    tmp.replace(output)
    return True


if __name__ == "__main__":
    build()
