"""What this machine is and what it can do: device, driver, versions, measured peaks, Sluice importable.

    python -m sluice.bench.probe --out probe.json --peaks peaks.json [--small]

Fails (exit 1, the reason on stderr) when a module the kernels, model or engine need cannot be imported,
when importing them drags in the HTTP stack (which the GPU image lacks), or, with `--require-gpu`, when
jax found no GPU (it falls back to the CPU with only a warning when its CUDA plugin cannot start).
Peaks: `bench.roofline.measure_peaks` for memory bandwidth and float32 matmuls, plus a bfloat16 matmul,
the rate a bf16 model's prefill is bound by; `--peaks` saves them with the bf16 rate, for the engine's
roofline. Arrays are GPU-sized on a GPU (4 GiB reads, 8192^3 matmuls) and small elsewhere or with `--small`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

# What the kernels, the model and the engine import between them (tokenizers and jinja2 come with the
# tokenizer, orbax with the checkpoint loader): everything a GPU image must have for bench.gpu_check.
REQUIRED_MODULES = ("jax", "flax", "numpy", "orbax.checkpoint", "tokenizers", "jinja2", "tqdm")
SLUICE_MODULES = tuple(f"sluice.{name}" for name in (
    "pallas_kernels.attention", "model.loader", "model.paged_attend", "batching.engine", "bench.engine_check",
    "bench.kernels"))
HTTP_STACK = ("starlette", "uvicorn", "sluice.app")


def missing_modules() -> list[str]:
    missing = []
    for name in REQUIRED_MODULES + SLUICE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    return missing


def nvidia_smi() -> dict[str, str]:
    """Driver version, GPU name and memory from nvidia-smi, or {} where there is none."""
    fields = ("driver_version", "name", "memory.total")
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    return dict(zip(fields, (part.strip() for part in out.split(","))))


def bf16_matmul_gflops(n: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def probe(force_small: bool) -> tuple[dict, object]:
    import flax
    import jax

    from sluice.bench.roofline import Peaks, measure_peaks
    from sluice.pallas_kernels.mosaic_attention import runs_on

    device = jax.devices()[0]
    small = force_small or device.platform != "gpu"
    info = dict(small=small,
        date=datetime.date.today().isoformat(), platform=device.platform, device_kind=device.device_kind,
        device_count=jax.device_count(), compute_capability=getattr(device, "compute_capability", None),
        jax=jax.__version__, jaxlib=importlib.import_module("jaxlib").__version__, flax=flax.__version__,
        python=platform.python_version(), host=platform.platform(), nvidia_smi=nvidia_smi(),
    )
    try:
        info["platform_version"] = device.client.platform_version
    except AttributeError:
        info["platform_version"] = None
    stats = device.memory_stats() or {}
    info["memory_limit_bytes"] = stats.get("bytes_limit")
    info["mosaic_gpu"] = runs_on(device)
    if small:
        peaks = measure_peaks(elements=1 << 22, matmul_sizes=(256,), repeats=2)
        bf16 = bf16_matmul_gflops(256, 2)
    else:
        peaks = measure_peaks(elements=1 << 30, matmul_sizes=(4096, 8192), repeats=5)
        bf16 = bf16_matmul_gflops(8192, 5)
    info.update(bandwidth_gbs=peaks.bandwidth_gbs, f32_matmul_gflops=peaks.matmul_gflops, bf16_matmul_gflops=bf16)
    return info, Peaks(peaks.bandwidth_gbs, bf16, peaks.device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="machine description JSON")
    parser.add_argument("--peaks", type=Path, required=True, help="peaks JSON for bench.roofline (bf16 matmul rate)")
    parser.add_argument("--small", action="store_true", help="measure peaks at CPU-sized arrays even on a GPU")
    parser.add_argument("--require-gpu", action="store_true", help="fail unless jax runs on a GPU")
    args = parser.parse_args(argv)
    if args.require_gpu:
        import jax

        if jax.default_backend() != "gpu":
            print(f"cannot run: no GPU (jax {jax.__version__} runs on {jax.default_backend()}; is its CUDA plugin "
                  "installed, and the driver visible?)", file=sys.stderr)
            return 1
    if missing := missing_modules():
        print("cannot run: missing or broken modules: " + "; ".join(missing), file=sys.stderr)
        return 1
    if leaked := sorted(set(HTTP_STACK) & set(sys.modules)):
        print(f"cannot run: importing the kernels, model and engine imported the HTTP stack: {leaked}", file=sys.stderr)
        return 1
    info, peaks = probe(args.small)
    args.out.write_text(json.dumps(info, indent=2) + "\n")
    peaks.save(args.peaks)
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
