"""The CPU kernels' shared library, loaded once per process and registered with XLA's FFI.

`load()` takes the best ISA variant this CPU runs (`cpu_build.candidates()`: AVX-512 with VNNI, AVX-VNNI, or the
x86-64-v3 baseline on x86; the portable build through SIMDe elsewhere), built on first use into the cache
(`cpu_build.py`); a variant whose build fails falls back to the next. Where none can be had (no compiler, an x86
CPU without AVX2, no SIMDe, a failed build), it says why once, at the first use, and callers take pure-XLA forms:
`available()` of `cpu_qmatmul` and `cpu_attention` is False.
`python -m sluice.pallas_kernels.cpu_library` builds at install time (`make serve` / `make test`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from pathlib import Path
from typing import NamedTuple

import jax

from sluice.pallas_kernels import cpu_build
from sluice.pallas_kernels.cpu_build import BuildError, Variant

logger = logging.getLogger(__name__)


class Library(NamedTuple):
    """The loaded library and the build it came from."""

    dll: ctypes.CDLL
    variant: Variant
    path: Path


def _failure(variant: Variant, error: Exception) -> str:
    if isinstance(error, BuildError) and error.earlier:
        return (f"the {variant.name} build failed at an earlier start (recorded in {error.record}, not retried until "
                f"the sources or the compiler change; delete it to retry): {error}")
    return f"the {variant.name} build failed: {error}"


def find() -> tuple[Library | None, list[str]]:
    """The library for the best variant that builds, loads and runs here (or None), and why each better variant
    could not be had."""
    try:
        variants = cpu_build.candidates()
    except BuildError as error:
        return None, [str(error)]
    compiler = cpu_build.find_compiler()
    failures = []
    for variant in variants:
        try:
            path = cpu_build.build(variant, compiler)
            dll = ctypes.CDLL(str(path))
        except (BuildError, OSError) as error:
            failures.append(_failure(variant, error))
            if compiler.command is None:
                break  # no variant builds without a compiler
            continue
        if dll.SluiceCpuSupported():
            return Library(dll, variant, path), failures
        failures.append(f"this CPU lacks what the {variant.name} build needs")
    return None, failures


@functools.cache
def load() -> Library | None:
    """The library, built if needed; None if none can be had here. Says which, or why not, once per process."""
    library, failures = find()
    if library is None:
        logger.warning("CPU kernels unavailable (pure-XLA forms run instead): %s", "; ".join(failures))
        return None
    for failure in failures:
        logger.warning("CPU kernels: %s; using the %s build", failure, library.variant.name)
    logger.info("CPU kernels: the %s build (%s)", library.variant.name, library.path)
    return library


@functools.cache
def register(target: str, symbol: str) -> bool:
    """Registers `symbol` of the library as the CPU FFI target `target`; False when the library is unavailable."""
    library = load()
    if library is None:
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library.dll, symbol)), platform="cpu")
    return True


if __name__ == "__main__":  # python -m sluice.pallas_kernels.cpu_library: build at install time
    library, failures = find()
    for failure in failures:
        print(f"CPU kernels: {failure}", file=sys.stderr)
    if library is None:
        print("CPU kernels not built; Sluice will use pure-XLA forms", file=sys.stderr)
    else:
        print(f"{library.variant.name}: {library.path}")
