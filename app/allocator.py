"""mimalloc in place of glibc's malloc for the `sluice` command's process (Linux).

XLA:CPU allocates a program's outputs and temporaries afresh at every call. glibc maps each allocation above 32 MiB
anew and unmaps it when freed, so the kernel zeroes its pages again at their first touch in every step: a [256,
128256] f32 logits array is 32,768 page faults a step. mimalloc keeps freed memory for the next allocation. On a
2-core AMD EPYC, `bench.host_overhead` with a 128k vocabulary at batch 256 stepped in 130 ms instead of 345, and
XLA's compiles (malloc-bound) take 10 to 15% less (bench/RESULTS.md). The command re-executes itself with the
library preloaded, the step vLLM's and SGLang's CPU guides leave to the user (for tcmalloc);
`SLUICE_MALLOC=system` keeps glibc's malloc.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from sluice.app.arguments import CommandError

MIMALLOC = "cmeel-mimalloc"  # the wheel that ships mimalloc's shared library
CHOICES = ("mimalloc", "system")  # SLUICE_MALLOC's values


def mimalloc_library() -> Path | None:
    """mimalloc's shared library among the `cmeel-mimalloc` distribution's files; None where it is not installed
    or the platform has no LD_PRELOAD."""
    if sys.platform != "linux":
        return None
    try:
        files = importlib.metadata.distribution(MIMALLOC).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    library = next((file for file in files if file.name.startswith("libmimalloc.so.")
                    and file.name.count(".") == 2), None)  # libmimalloc.so.3, the soname
    return None if library is None else Path(library.locate())


def preload_mimalloc() -> None:
    """Re-executes this process (the same pid and command line) with mimalloc preloaded, unless it is preloaded
    already, the library is missing, or SLUICE_MALLOC=system. Call it first, before anything heavy is imported."""
    choice = os.environ.get("SLUICE_MALLOC", "mimalloc")
    if choice not in CHOICES:
        raise CommandError(f"SLUICE_MALLOC must be one of {', '.join(CHOICES)}, not {choice!r}")
    library = mimalloc_library()
    preloaded = os.environ.get("LD_PRELOAD", "")
    if library is None or choice == "system" or str(library) in preloaded:
        return
    env = {**os.environ, "LD_PRELOAD": f"{library} {preloaded}".strip()}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


if __name__ == "__main__":  # the Makefile's `make test` preloads what this prints
    print(mimalloc_library() or "")
