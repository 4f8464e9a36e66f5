"""The GPU path in one command: kernels, engine and throughput proven (or disproven) on the accelerator here.

    python -m sluice.bench.gpu_check --out gpu-check --require-gpu        (make gpu-check)

Steps, each in its own process, so that a crash or a hung kernel ends its step and not the run, and every
step starts with the device's memory free; all under one time budget (--budget-s, 9 minutes by default):

1. probe (`bench.probe`): device, driver, versions, measured peaks. Stops the run, with the reason, when a
   module the kernels, model or engine need is missing, the HTTP stack gets imported, or (--require-gpu)
   jax found no GPU.
2. kernel correctness: tests/test_paged_attention.py (float64 oracle, jax's shipped paged attention) and
   tests/test_kernel_lowering.py, every kernel compiled; the Mosaic GPU tests run in a second process after
   the others, so a Mosaic failure cannot hide the Triton results.
3. kernel benchmark (`bench.kernels`): decode at batch {1, 8, 64, 256} x context {512, 2048, 8192},
   Llama-3-8B heads, bf16: time per call and bandwidth of both kernel families and jax's shipped kernel (Mosaic
   again in its own process, with its kernel's own traced time beside the call's), each row's largest difference
   from the jnp reference.
4. engine (`bench.engine_check`), one process per model: Llama-3-8B (skipped when the device cannot hold
   it), SmolLM2-135M, Llama-3.2-1B, random weights with real shapes, bf16, concurrency 1, 64, 256 and 1,024,
   with a profiler trace of decode steps at each (`bench.device_profile`: device busy against the step period).
5. step audit (`bench.step_audit`): the compiled decode step's bytes and HLO findings on this device, and the
   host syncs (conditionals) of the multi-step decode call.

Writes three files to --out: report.md (markdown ready for bench/RESULTS.md, also printed), results.json
(every figure) and log.txt (every step's output). Steps run in that order and each gets at most its own
cap and what is left of the budget; a step with too little time left is skipped and says so, and
`--steps` / `--models` rerun a part in a second command. Exit status 1 when a step failed or timed out.

`--xla-flags` runs every step under more XLA flags, to set a setting against the defaults in a second run.

Without a GPU the same steps run at small sizes (a kernel-test subset in interpret mode, a tiny benchmark,
a tiny model on the CPU): tests/test_gpu_check.py runs it that way in `make test`, so it cannot rot.
`make check-gpu-image` runs those tests and the kernel lowering on a CPU under the GPU image's jax
(Python 3.12, jax 0.11.2, no HTTP stack) before a GPU session.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sluice.bench.gpu_report import KERNEL_BACKENDS, StepResult, report

ROOT = Path(__file__).resolve().parent.parent
# Llama-3-8B first: its figures are the ones the GPU issues are judged by, so a tight budget cuts the others.
GPU_MODELS = ("llama-3-8b", "smollm2-135m", "llama-3.2-1b")
CPU_MODELS = ("tiny",)
STEP_NAMES = ("kernel-tests", "kernel-bench", "engine", "step-audit")
# Seconds a step needs at least to be worth starting, and the most each may take (GPU sizes). Every model's engine
# compiles its 32 programs of unrolled layers in about 120 s on an H200's host, whatever its size (2026-11-28:
# SmolLM2's whole step took 195 s, the 8B's 235); since the quarter-octave token buckets, 44 programs, the 8B's in
# 173 s (2026-12-04: its step reached C=1,024's direct step at 330 s, so that level needs about 420).
MIN_STEP_S = 20.0
# Steps that cannot finish in much less: started with less of the budget left, they would time out having measured
# nothing, where the steps after them could have run.
NEEDS_S = {"engine-smollm2-135m": 180.0, "engine-llama-3.2-1b": 180.0, "engine-llama-3-8b": 260.0}
CAPS_S = {"probe": 120.0, "kernel-tests": 150.0, "kernel-tests-mosaic": 90.0, "kernel-bench": 150.0,
          "kernel-bench-mosaic": 90.0, "engine-smollm2-135m": 240.0, "engine-llama-3.2-1b": 240.0,
          "engine-llama-3-8b": 420.0, "engine-tiny": 120.0, "step-audit": 90.0}
# The CPU subset of the kernel tests: one case of each kind, every backend (Mosaic's skip included).
CPU_TEST_FILTER = ("test_decode_gives_zeros or (ragged_matches and (0-reference or 0-pallas)) or shipped "
                   "or mosaic_backend or (lowers_for_cuda and smollm2-135m-bf16)")
CPU_BENCH_ARGS = ("--backends", "pallas-triton", "reference", "--interpret", "--trace", "--batches", "2",
                  "--contexts", "40", "--num-q-heads", "8", "--num-kv-heads", "2", "--head-dim", "64",
                  "--dtype", "float32", "--calls", "1", "--repeats", "1")
TEST_FILES = ("tests/test_paged_attention.py", "tests/test_kernel_lowering.py")
# XLA's command buffers (CUDA graphs) with conditionals and loops too, even for short runs of kernels: the
# experiment for the decode call's host syncs (bench.step_audit) and launch gaps.
COMMAND_BUFFERS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE "
                   "--xla_gpu_graph_min_graph_size=1")


@dataclass
class Run:
    """One gpu_check run: where it writes, how long it may take, what each step gave."""

    out: Path
    work: Path
    budget_s: float
    started: float = field(default_factory=time.perf_counter)
    steps: list[StepResult] = field(default_factory=list)

    @property
    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def skip(self, name: str, note: str) -> None:
        self.steps.append(StepResult(name, "skipped", note=note))

    def step(self, name: str, command: list[str], env: dict[str, str]) -> StepResult:
        """Runs `command` (from the project root) for at most its cap and the budget left; output to log.txt."""
        timeout = min(CAPS_S[name], self.left_s)
        if timeout < NEEDS_S.get(name, MIN_STEP_S):
            self.skip(name, f"{max(self.left_s, 0):.0f} s of the budget left")
            return self.steps[-1]
        print(f"[gpu_check] {name}: {shlex.join(command)} (at most {timeout:.0f} s)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        with open(self.out / "log.txt", "a") as log:
            log.write(f"\n===== {name}: {shlex.join(command)}\n")
            log.flush()
            output_starts = log.tell()
            try:
                proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=timeout, check=False)
                status = "ok" if proc.returncode == 0 else "failed"
                note = "" if proc.returncode == 0 else f"exit status {proc.returncode}: {last_line(log, output_starts)}"
            except subprocess.TimeoutExpired:
                status, note = "timed out", f"stopped after {timeout:.0f} s; see log.txt"
        result = StepResult(name, status, time.perf_counter() - start, note)
        self.steps.append(result)
        print(f"[gpu_check] {name}: {status} in {result.seconds:.0f} s", file=sys.stderr, flush=True)
        return result


def last_line(log, start: int) -> str:
    """The last non-blank line a step wrote to the log (its error, when it failed)."""
    with open(log.name) as f:
        f.seek(start)
        lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def child_env(work: Path, xla_flags: str = "") -> dict[str, str]:
    """A fresh persistent compilation cache, so the engine's compile time is a cold start's; `xla_flags` after
    those of XLA_FLAGS."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "SLUICE_JAX_CACHE": str(work / "jax-cache"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS"), xla_flags]))}


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def junit_outcomes(junit_xml: Path) -> list[dict]:
    """[{name, backend, outcome, message}] from a pytest --junitxml file; [] if pytest never wrote it."""
    if not junit_xml.exists():
        return []
    outcomes = []
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (element.get("message") or element.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        backend = next((b for b in KERNEL_BACKENDS if b in name), "pallas-mosaic" if "mosaic" in name else "other")
        outcomes.append(dict(name=name, backend=backend, outcome=outcome, message=message))
    return outcomes


def run_kernel_tests(run: Run, env: dict[str, str], small: bool) -> list[dict]:
    outcomes = []
    if small:
        parts = [("kernel-tests", CPU_TEST_FILTER)]
    else:
        parts = [("kernel-tests", "not mosaic"), ("kernel-tests-mosaic", "mosaic")]
    for name, selection in parts:
        junit = run.work / f"{name}.xml"
        run.step(name, python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection,
                              f"--junitxml={junit}", *TEST_FILES), env)
        outcomes += junit_outcomes(junit)
    return outcomes


def run_kernel_bench(run: Run, env: dict[str, str], small: bool, probe: dict) -> list[dict]:
    # On a GPU the jnp reference is not timed (it reads at 3-4% of the bandwidth, 64 ms a call at the largest size):
    # every row still reports its difference from the reference's output.
    parts = [("kernel-bench", list(CPU_BENCH_ARGS) if small else ["--backends", "pallas-triton", "jax-shipped"])]
    if not small and probe["mosaic_gpu"]:
        parts.append(("kernel-bench-mosaic", ["--backends", "pallas-mosaic", "--trace"]))
    elif not small:
        run.skip("kernel-bench-mosaic", f"Mosaic GPU needs compute capability 9.0+, this is {probe['compute_capability']}")
    rows = []
    for name, args in parts:
        rows_json = run.work / f"{name}.json"
        run.step(name, python("-m", "sluice.bench.kernels", *args, "--json", str(rows_json)), env)
        if rows_json.exists():
            rows += json.loads(rows_json.read_text())["rows"]
    order = {b: i for i, b in enumerate(("pallas-triton", "pallas-mosaic", "reference", "jax-shipped"))}
    rows.sort(key=lambda r: (r["batch"], r["context"], order.get(r["backend"], 9)))
    return rows


def run_engines(run: Run, env: dict[str, str], small: bool, models: list[str], backend: str,
                sampler_branches: str, quantization: str, engine_args: list[str]) -> list[dict]:
    results = []
    for model in models:
        out = run.work / f"engine-{model}.json"
        step = run.step(f"engine-{model}", python(
            "-m", "sluice.bench.engine_check", "--model", model, "--peaks", str(run.work / "peaks.json"), "--out", str(out),
            "--attention-backend", backend, "--sampler-branches", sampler_branches, "--quantization", quantization,
            *(["--small"] if small else []), *engine_args,
        ), env)
        result = json.loads(out.read_text()) if out.exists() else dict(model=model, levels=[])
        if "skipped" in result and step.status == "ok":
            step.status, step.note = "skipped", result["skipped"]
        results.append(result)
    return results


def run_step_audit(run: Run, env: dict[str, str], small: bool, models: list[str], sampler_branches: str,
                   quantization: str) -> str | None:
    """The step-bytes audit of the engine's compiled decode step on this device: a markdown table, or None."""
    out = run.work / "step-audit.md"
    sizes = ["--rows", "2", "--context", "64"] if small else ["--rows", "64", "--context", "2048"]
    run.step("step-audit", python("-m", "sluice.bench.step_audit", "--models", *models, "--dtypes", "bfloat16", *sizes,
                                  "--sampler-branches", sampler_branches, "--quantization", quantization,
                                  "--out", str(out)), env)
    return out.read_text() if out.exists() else None


def unfinished(steps: list[StepResult], out: Path) -> str | None:
    """The command that reruns what ran out of time (skipped for the budget, or timed out), or None. It writes
    under this run's folder, so a tool that fetches the folder brings both runs back."""
    late = [s.name for s in steps if s.status == "timed out" or (s.status == "skipped" and "budget" in s.note)]
    if not late:
        return None
    names = list(dict.fromkeys(n.removesuffix("-mosaic") for n in late if not n.startswith("engine-")))
    models = [n.removeprefix("engine-") for n in late if n.startswith("engine-")]
    command = ["python", "-m", "sluice.bench.gpu_check", "--out", str(out / "more"), "--require-gpu", "--steps", *names]
    if models:
        command += ["engine", "--models", *models]
    return shlex.join(command)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for report.md, results.json, log.txt")
    parser.add_argument("--budget-s", type=float, default=540.0, help="time for the whole run, in seconds")
    parser.add_argument("--steps", nargs="+", choices=STEP_NAMES, default=list(STEP_NAMES),
                        help="which steps to run after the probe")
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"engine models (default: {' '.join(GPU_MODELS)} on a GPU, {' '.join(CPU_MODELS)} "
                             "elsewhere)")
    parser.add_argument("--attention-backend", default="auto", help="the engine's attention backend")
    parser.add_argument("--sampler-branches", default="auto",
                        help="who decides the engine's sampler branches: auto, device or host (the engine's flag; "
                             "device: the comparison with the host's plans, auto's choice on a GPU)")
    parser.add_argument("--small", action="store_true", help="small sizes even on a GPU (the CPU default)")
    parser.add_argument("--engine-args", type=shlex.split, default=[],
                        help="more flags for each engine step (`bench.engine_check`'s), in one string: "
                             "'--temperature 0.8 --top-p 0.95' samples; '--concurrency 1 256' runs those levels alone")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                        help="the engine's and the step audit's weights (int8: does weight-only int8 pay here, so that "
                             "--quantization auto should take it?)")
    parser.add_argument("--xla-flags", default="",
                        help="XLA flags for every step (after XLA_FLAGS'), to compare a setting against the defaults "
                             f"in a second run: {COMMAND_BUFFERS!r}, say, captures the decode call's conditionals "
                             "and loops in CUDA graphs (bench/RESULTS.md)")
    parser.add_argument("--require-gpu", action="store_true",
                        help="stop at once unless jax runs on a GPU (what `make gpu-check` passes)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m sluice.bench.gpu_check " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "log.txt").write_text(f"{command}\n")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        run = Run(args.out, Path(work), args.budget_s)
        env = child_env(run.work, args.xla_flags)
        results: dict = dict(command=command)
        probe_json = run.work / "probe.json"
        options = [flag for flag, on in (("--small", args.small), ("--require-gpu", args.require_gpu)) if on]
        probe = run.step("probe", python("-m", "sluice.bench.probe", "--out", str(probe_json), "--peaks",
                                         str(run.work / "peaks.json"), *options), env)
        if probe.status == "ok":
            results["probe"] = json.loads(probe_json.read_text())
            small = results["probe"]["small"]
            models = args.models or list(CPU_MODELS if small else GPU_MODELS)
            if "kernel-tests" in args.steps:
                results["kernel-tests"] = run_kernel_tests(run, env, small)
            if "kernel-bench" in args.steps:
                results["kernel-bench"] = run_kernel_bench(run, env, small, results["probe"])
            if "engine" in args.steps:
                results["engine"] = run_engines(run, env, small, models, args.attention_backend, args.sampler_branches,
                                                args.quantization, args.engine_args)
            if "step-audit" in args.steps:
                results["step-audit"] = run_step_audit(run, env, small, models, args.sampler_branches,
                                                       args.quantization)
        else:
            small = True
            print("[gpu_check] the probe failed, so nothing else can run: see log.txt", file=sys.stderr)
        results["wall_s"] = time.perf_counter() - run.started
        results["steps"] = [asdict(s) for s in run.steps]
        results["unfinished"] = unfinished(run.steps, args.out)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results, command, small)
    (args.out / "report.md").write_text(text + "\n")
    print(text)
    return 0 if all(s.status in ("ok", "skipped") for s in run.steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
