"""The CPU comparison in one command: Sluice against HF transformers static batching, same workload, same run.

1. Measures the machine's peaks (memory bandwidth, matmul rate) before anything else runs.
2. Starts `sluice serve` on a free loopback port and waits for /health.
3. Sluice at saturation: every request sent at once (continuous batching up to --max-num-seqs).
4. Sluice one request at a time (max concurrency 1) on the first --single-requests of the workload.
5. Stops the server, then runs the HF baseline (`bench/hf_baseline.py`) in `.venv-bench-ref` on the
   same workload file, in static batches of each of --hf-batch-sizes.
Prints one table with the ratio to the best HF batch size and the command, and writes it all as JSON. Sets up nothing itself:
`make bench` builds both environments first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python bench/compare.py` puts bench/, not the root, on the path

from bench.dataset import BenchRequest, fresh_prompts, save_jsonl  # noqa: E402
from bench.metrics import Slo  # noqa: E402
from bench.roofline import measure_peaks, read_model_config, workload_roofline  # noqa: E402
from bench.serve import LoadConfig, RunResult, add_dataset_arguments, benchmark, load_dataset, report  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"sluice serve exited with {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"sluice serve not ready after {timeout_s:.0f} s")


def start_server(port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len), "--log-level", "warning",
    ]
    if args.kv_cache_memory is not None:
        command += ["--kv-cache-memory", args.kv_cache_memory]
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _row(name: str, requests: int, out_tps: float, total_tps: float, duration: float, extra: str) -> str:
    return f"| {name} | {requests} | {out_tps:.1f} | {total_tps:.1f} | {duration:.1f} | {extra} |"


def _sluice_row(name: str, r: RunResult) -> str:
    s = r.summary
    return _row(
        name, s.completed, s.output_throughput, s.total_token_throughput, s.duration_s,
        f"TTFT p50 {s.ttft_ms.median:.0f} ms, TPOT p50 {s.tpot_ms.median:.0f} ms, batch {s.mean_decode_batch:.1f}, "
        f"{s.output_throughput / r.roofline.bound_output_tps:.1%} of roofline",
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/compare.py", description=__doc__.split("\n\n")[0])
    add_dataset_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="Sluice's running batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024,
                        help="Sluice's context limit; the default workload's longest request is 512 + 192 tokens")
    parser.add_argument("--kv-cache-memory", default=None, help="Sluice's KV pool, e.g. 512MiB (default: engine's)")
    parser.add_argument("--single-requests", type=int, default=8,
                        help="how many of the workload's requests the one-at-a-time run sends")
    parser.add_argument("--hf-python", type=Path, default=ROOT / ".venv-bench-ref/bin/python")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64],
                        help="static batch sizes the baseline runs at; the ratio is to the fastest")
    parser.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for the server")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/compare")
    args = parser.parse_args()
    command = shlex.join(["python", "bench/compare.py", *sys.argv[1:]])
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.hf_python.exists():
        print(f"no baseline environment at {args.hf_python}; `make bench` creates it", file=sys.stderr)
        return 2

    peaks = measure_peaks()
    print(f"peaks: {peaks.bandwidth_gbs:.1f} GB/s, {peaks.matmul_gflops:.0f} GFLOP/s ({peaks.device})", flush=True)
    requests, dataset = load_dataset(args)
    workload = args.out / "workload.jsonl"
    save_jsonl(requests, workload)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, args, args.out / "server.log")
    try:
        wait_ready(url, server, args.ready_timeout)
        # Two short requests first, so nothing lazy on the server's first request lands in the timed runs.
        # Every run gets prompts of its own: none may be served from the prefix cache a previous one filled.
        warmup = [BenchRequest(r.prompt[:16], 2) for r in fresh_prompts(requests[:2], salt=1)]
        benchmark(warmup, LoadConfig(url, seed=args.seed), Slo(), peaks, None, "float32")
        saturated = benchmark(requests, LoadConfig(url, seed=args.seed), Slo(), peaks, None, "float32")
        print(report(saturated, command), flush=True)
        single = benchmark(
            fresh_prompts(requests[: args.single_requests], salt=2), LoadConfig(url, max_concurrency=1, seed=args.seed),
            Slo(), peaks, None, "float32",
        )
        print(report(single, command), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)

    hf_runs = []
    for batch_size in args.hf_batch_sizes:
        hf_json = args.out / f"hf_baseline_b{batch_size}.json"
        subprocess.run(
            [str(args.hf_python), "-m", "bench.hf_baseline", "--workload", str(workload),
             "--batch-size", str(batch_size), "--result-json", str(hf_json)],
            cwd=ROOT, check=True,
        )
        hf = json.loads(hf_json.read_text())
        hf["roofline"] = asdict(workload_roofline(
            read_model_config(None), "float32", peaks,
            [r.prompt_tokens for r in requests], [r.output_tokens for r in requests], batch_size,
        ))
        hf_runs.append(hf)
    best_hf = max(hf_runs, key=lambda hf: hf["output_throughput"])

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    ratio = saturated.summary.output_throughput / best_hf["output_throughput"]
    table = [
        f"CPU comparison, {datetime.date.today().isoformat()}, commit {commit}; {dataset}",
        f"peaks measured: {peaks.bandwidth_gbs:.1f} GB/s memory, {peaks.matmul_gflops:.0f} GFLOP/s float32 matmul",
        "",
        "| system | requests | output tok/s | total tok/s | duration s | notes |",
        "| --- | --- | --- | --- | --- | --- |",
        _sluice_row(f"Sluice, saturation (all at once, max-num-seqs {args.max_num_seqs})", saturated),
        _sluice_row("Sluice, one request at a time", single),
        *(_row(
            f"HF transformers {hf['versions']['transformers']} static batch {hf['batch_size']}", hf["completed"],
            hf["output_throughput"], hf["total_token_throughput"], hf["duration_s"],
            f"{hf['generated_tokens']} tokens generated for {hf['output_tokens']} requested, "
            f"{hf['output_throughput'] / hf['roofline']['bound_output_tps']:.1%} of roofline at batch {hf['batch_size']}",
        ) for hf in hf_runs),
        "",
        f"Sluice saturation / HF static batching at its best batch size ({best_hf['batch_size']}), "
        f"output tokens/s: {ratio:.2f}x",
        saturated.roofline.line(saturated.summary.output_throughput),
        f"command: {command}",
    ]
    print("\n" + "\n".join(table))
    (args.out / "compare.json").write_text(json.dumps({
        "command": command,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "dataset": dataset,
        "peaks": asdict(peaks),
        "sluice_saturation": asdict(saturated.summary) | {"roofline": asdict(saturated.roofline)},
        "sluice_single": asdict(single.summary) | {"roofline": asdict(single.roofline)},
        "hf_static": hf_runs,
        "ratio_output_tps": ratio,
        "table": table,
    }, indent=2) + "\n")
    print(f"results: {args.out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
