"""The `sluice` command's process re-executes itself with mimalloc preloaded (app/allocator.py): the same pid, the
library mapped, and glibc's malloc kept where SLUICE_MALLOC=system says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sluice.app.allocator import mimalloc_library

pytestmark = pytest.mark.skipif(mimalloc_library() is None, reason="mimalloc's wheel is Linux-only here")

# Prints its pid before the re-exec (LD_PRELOAD then names no mimalloc) and after it, with whether the library is
# mapped into the process.
PROGRAM = """
import os
from sluice.app.allocator import preload_mimalloc
if "mimalloc" not in os.environ.get("LD_PRELOAD", ""):
    print("before", os.getpid(), flush=True)
preload_mimalloc()
with open("/proc/self/maps") as maps:
    print("after", os.getpid(), "libmimalloc" in maps.read(), os.environ.get("LD_PRELOAD", ""), flush=True)
"""


def run(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60)


def test_the_process_runs_again_as_itself_with_mimalloc_mapped_and_other_preloads_kept():
    lines = run(LD_PRELOAD="libm.so.6", SLUICE_MALLOC="mimalloc").stdout.split("\n")
    before, after = lines[0].split(), lines[1].split()
    assert before[0] == "before" and after[:3] == ["after", before[1], "True"]
    assert after[3:] == [str(mimalloc_library()), "libm.so.6"]


def test_system_keeps_glibcs_malloc_without_running_again():
    lines = run(LD_PRELOAD="", SLUICE_MALLOC="system").stdout.split("\n")
    assert lines[0].startswith("before") and lines[1].split()[2] == "False"


def test_an_unknown_choice_is_a_one_line_error_of_the_command():
    result = subprocess.run([sys.executable, "-m", "sluice.app.cli", "serve", "--help"],
                            env={**os.environ, "SLUICE_MALLOC": "glibc"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "sluice: error: SLUICE_MALLOC must be one of mimalloc, system, not 'glibc'\n"
