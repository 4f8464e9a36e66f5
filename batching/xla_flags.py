"""The XLA flags Sluice sets by default where jax may start a CUDA backend, before it starts."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, MutableMapping

# XLA:GPU captures runs of a step's kernels in command buffers (CUDA graphs) by default, and records a graph again
# before a run whenever a buffer it uses has moved: a step's inputs are new buffers at every call, so every call
# re-recorded its graphs on the launching thread while the device waited. XLA runs op by op under its profiler, and
# there the H200's decode calls ran 17-21% faster than untraced (bench/RESULTS.md, 2026-12-04): 4.46 against 5.39 ms
# a token at one sequence, 9.58 against 11.7 at 256.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def without_command_buffers(environ: MutableMapping[str, str]) -> None:
    """Turns XLA:GPU's command buffers off in `environ`'s XLA_FLAGS, for a CUDA backend not yet started, unless the
    flags choose them already (a user's setting wins), or name a file of flags (XLA reads a value that does not
    start with "-" as one, and would take a flag added after it as part of the file's name). Where jax cannot
    start a CUDA backend it adds nothing, so a CPU's compilation cache keys stay as they were."""
    flags = environ.get("XLA_FLAGS", "")
    names_a_file = bool(flags.strip()) and not flags.lstrip().startswith("-")
    if not names_a_file and "--xla_gpu_enable_command_buffer" not in flags and cuda_may_start(environ):
        environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()


def cuda_may_start(environ: Mapping[str, str]) -> bool:
    """Whether jax may start a CUDA backend: its CUDA plugin is installed and JAX_PLATFORMS, if set, allows it."""
    platforms = {p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if platforms and not platforms & {"cuda", "gpu"}:
        return False
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{major}") for major in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False
