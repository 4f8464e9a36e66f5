"""Building the CPU kernels' shared library (every `pallas_kernels/*.cc`) into a cache, one build per ISA variant.

The C++ sources ship inside the package and are compiled on first use (or at install time, `python -m
pallas_kernels.cpu_library`). A build targets an ISA variant rather than the machine: on x86, VARIANTS, best
first, down to the baseline x86-64-v3 (AVX2, FMA, F16C), of which `candidates()` keeps those the CPU runs (its
/proc/cpuinfo flags); on any other CPU (ARM64: Apple Silicon, Graviton), PORTABLE: the same sources against
SIMDe, which implements the x86 intrinsics there (with NEON on ARM), its headers from the `cmeel-simde` wheel.
`$SLUICE_CPU_ISA` names one variant instead (the tests build the narrower ones, and the portable one, that way).

Each build lives in `<cache>/<variant>-<key>/` (`cache_root()`: `$SLUICE_HOME/kernels`), the key a hash of the
sources, the flags (SIMDe's include folder among them; `$SLUICE_CXXFLAGS` appended), the compiler (its path and
`--version`), jax's version (its FFI headers) and the machine type. A changed source or compiler gets a fresh
build; any CPU of a variant's ISA can use its build. A build that fails is recorded in its folder (FAILED: why)
and not tried again while the key stays the same, that is until the sources or the compiler change (or, for the
portable build, SIMDe is installed). A missing compiler is recorded the same way, keyed by the name that was
looked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax

SOURCES = sorted(Path(__file__).parent.glob("*.cc"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
LIBRARY = "libsluice_cpu.so"
FAILED = "FAILED"
COMMON_FLAGS = ("-O3", "-fopenmp-simd", "-std=c++17", "-fPIC", "-pthread")
X86 = {"x86_64", "amd64"}
SIMDE = "cmeel-simde"  # the wheel of SIMDe's headers
_REASON_CHARS = 4000  # of the compiler's output kept in a failure record


class BuildError(RuntimeError):
    """The library could not be built: no compiler, or the compiler failed. `record` is the cache file that holds
    the reason; `earlier` is True when that build failed at an earlier start (and was not tried again)."""

    def __init__(self, reason: str, record: Path | None = None, earlier: bool = False):
        super().__init__(reason)
        self.record, self.earlier = record, earlier


@dataclass(frozen=True)
class Variant:
    """An ISA the library is compiled for: `flags` for the compiler, `needs` the /proc/cpuinfo flags of a CPU
    that runs it, `simde` whether it is compiled against SIMDe's intrinsics rather than the compiler's."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]
    simde: bool = False


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})  # abm: LZCNT
BASELINE = Variant("x86-64-v3", ("-march=x86-64-v3",), _V3)
VARIANTS = (
    # The kernels' 512-bit path needs AVX-512 F, BW and VNNI; x86-64-v4 adds CD, DQ and VL.
    Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"),
            _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}),
    # AVX2 registers with VNNI's vpdpbusd (CPUs without AVX-512 that have AVX-VNNI).
    Variant("avx-vnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}),
    BASELINE,
)
# Any CPU: at the compiler's default target, the kernels' AVX2 paths through SIMDe (cpu_simd.h).
PORTABLE = Variant("portable", ("-DSLUICE_SIMDE",), frozenset(), simde=True)


@dataclass(frozen=True)
class Compiler:
    """The C++ compiler: `command` to run (None when missing) and `identity`, what the cache key holds (its path
    and `--version`, or the name that was not found)."""

    command: tuple[str, ...] | None
    identity: str


def cache_root() -> Path:
    return Path(os.environ.get("SLUICE_HOME", Path.home() / ".cache" / "sluice")) / "kernels"


def find_compiler() -> Compiler:
    """`$CXX` (a command, possibly with arguments), else g++ or c++ on PATH."""
    wanted = shlex.split(os.environ.get("CXX", ""))
    path = shutil.which(wanted[0]) if wanted else shutil.which("g++") or shutil.which("c++")
    if path is None:
        return Compiler(None, f"missing: {shlex.join(wanted) if wanted else 'g++ or c++'}")
    command = (path, *wanted[1:])
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        version = f"--version failed: {error}"
    return Compiler(command, f"{shlex.join(command)}\n{version}")


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo; None where there are none to read (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    line = next((line for line in lines if line.startswith("flags")), None)
    return None if line is None else frozenset(line.partition(":")[2].split())


def candidates() -> list[Variant]:
    """The variants to try here, best first: `$SLUICE_CPU_ISA`'s, else the portable one off x86, else those this
    x86 CPU runs (only the baseline where the flags are unknown: the library checks the CPU itself before its
    kernels are registered). BuildError (why) when there is none."""
    forced = os.environ.get("SLUICE_CPU_ISA")
    names = {variant.name: variant for variant in (*VARIANTS, PORTABLE)}
    if forced and forced not in names:
        raise BuildError(f"$SLUICE_CPU_ISA={forced} is not one of {', '.join(names)}")
    if forced == PORTABLE.name or (not forced and platform.machine().lower() not in X86):
        return [PORTABLE]
    flags = cpu_flags()
    if flags is None:
        return [names[forced] if forced else BASELINE]
    wanted = [names[forced]] if forced else list(VARIANTS)
    runnable = [variant for variant in wanted if variant.needs <= flags]
    if not runnable:
        missing = sorted(wanted[-1].needs - flags)
        raise BuildError(f"this CPU lacks what the {wanted[-1].name} build needs: {', '.join(missing)}")
    return runnable


def flags(variant: Variant) -> list[str]:
    return [*COMMON_FLAGS, *variant.flags, *_simde_flags(variant), *os.environ.get("SLUICE_CXXFLAGS", "").split()]


def simde_include() -> Path | None:
    """The folder holding SIMDe's `simde/` headers, found among the `cmeel-simde` distribution's files; None
    where it is not installed."""
    try:
        files = importlib.metadata.distribution(SIMDE).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    header = next((file for file in files if file.as_posix().endswith("simde/x86/avx2.h")), None)
    return None if header is None else Path(header.locate()).parents[2]


def _simde_flags(variant: Variant) -> list[str]:
    """SIMDe's include folder (none while it is missing: `_compile` then says what to install). On x86, SIMDe's
    own implementation of each intrinsic rather than the x86 instruction it would pass through to
    (SIMDE_NO_NATIVE): the code that stands in for the x86 instructions on other CPUs, built and tested here."""
    include = simde_include() if variant.simde else None
    if include is None:
        return []
    return [f"-I{include}", *(["-DSIMDE_NO_NATIVE"] if platform.machine().lower() in X86 else [])]


def build_folder(variant: Variant, compiler: Compiler) -> Path:
    """Where `variant`'s build by `compiler` of the current sources lives (its library, or its failure)."""
    key = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    key.update("\0".join([*flags(variant), compiler.identity, jax.__version__, platform.machine()]).encode())
    return cache_root() / f"{variant.name}-{key.hexdigest()[:16]}"


def build(variant: Variant, compiler: Compiler) -> Path:
    """The library built for `variant`: from the cache, else compiled now. BuildError if the build fails now (the
    reason then recorded) or failed before (the recorded reason; no new try)."""
    folder = build_folder(variant, compiler)
    library, record = folder / LIBRARY, folder / FAILED
    if library.exists():
        return library
    if record.exists():
        raise BuildError(record.read_text(), record, earlier=True)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        _compile(variant, compiler, library)
    except BuildError as error:
        _write_atomically(record, str(error))
        raise BuildError(str(error), record) from None
    return library


def _compile(variant: Variant, compiler: Compiler, library: Path) -> None:
    """Compiles the sources side by side, then links them into `library` (replaced atomically: a concurrent build
    of the same key lands the same bytes)."""
    if compiler.command is None:
        raise BuildError(f"no C++ compiler ({compiler.identity}; set $CXX or install g++)")
    if variant.simde and simde_include() is None:
        raise BuildError(f"the {variant.name} build needs SIMDe's headers: pip install {SIMDE}")
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        include = f"-I{jax.ffi.include_dir()}"
        _run_side_by_side([[*compiler.command, *flags(variant), include, "-c", str(source), "-o", str(obj)]
                           for source, obj in zip(SOURCES, objects)])
        output = Path(tmp) / LIBRARY
        _run_side_by_side([[*compiler.command, *flags(variant), "-shared", *map(str, objects), "-o", str(output)]])
        output.replace(library)


def _run_side_by_side(commands: list[list[str]]) -> None:
    """Runs `commands` at once (a build's wait is one source's compile on as many cores); BuildError with the
    first failure's command and output."""
    with contextlib.ExitStack() as stack:
        outputs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        jobs = []
        try:
            for command, output in zip(commands, outputs):
                jobs.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT))
        except OSError as error:
            raise BuildError(f"`{shlex.join(command)}` could not start: {error}") from None
        finally:
            codes = [job.wait() for job in jobs]
        for command, output, code in zip(commands, outputs, codes):
            if code != 0:
                output.seek(0)
                raise BuildError(f"`{shlex.join(command)}` failed:\n{output.read()[-_REASON_CHARS:]}")


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as file:
        file.write(text)
    Path(file.name).replace(path)
