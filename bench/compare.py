"""The CPU comparison in one command: Sluice against llama.cpp and HF transformers, same workload, same run.

1. Measures the machine's peaks (memory bandwidth, matmul rate) before anything else runs.
2. Starts `sluice serve` on a free loopback port, waits for /health, and runs the serving phases with
   `bench/serve.py`'s load generator: a short warm-up, the workload at saturation (every request sent at
   once; continuous batching up to --max-num-seqs), then --single-requests of it one at a time
   (max concurrency 1) for TTFT and TPOT. Stops the server.
3. The same phases, with the same token ids and output lengths, against `llama-server` (llama.cpp's
   OpenAI-compatible server, 64 slots of continuous batching; see `bench/llama_cpp.py`), whose own
   counters must show every prompt token computed afresh and exactly the requested tokens generated.
   Then `llama-bench -p 128 -n 128` on the same GGUF.
4. HF transformers (`bench/hf_baseline.py`, in `.venv-bench-ref`) on the same workload file in static
   batches of each of --hf-batch-sizes, and the one-at-a-time requests alone at batch 1 for its TTFT and TPOT.
Prints one table with the ratios and the command, and writes it all as JSON. Sets up nothing itself:
`make bench` builds both environments and llama.cpp first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python bench/compare.py` puts bench/, not the root, on the path

from bench import llama_cpp  # noqa: E402
from bench.dataset import BenchRequest, fresh_prompts, save_jsonl  # noqa: E402
from bench.metrics import RequestRecord, Slo, Summary, summarize  # noqa: E402
from bench.roofline import Peaks, ServedModel, measure_peaks, workload_roofline  # noqa: E402
from bench.serve import LoadConfig, RunResult, add_dataset_arguments, benchmark, load_dataset, report, result_json  # noqa: E402
from model.fetch import resolve_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{server.args[0]} exited with {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{server.args[0]} not ready after {timeout_s:.0f} s")


def sluice_command(port: int, args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len), "--log-level", "warning",
    ]
    if args.kv_cache_memory is not None:
        command += ["--kv-cache-memory", args.kv_cache_memory]
    return command


@dataclass(frozen=True)
class Phases:
    """The requests of each run against a server. Every run has token ids of its own, so none is served
    from the prefix cache a previous run filled; every system sees these same requests."""

    warmup: list[BenchRequest]
    saturation: list[BenchRequest]
    single: list[BenchRequest]

    @classmethod
    def of(cls, workload: list[BenchRequest], single_requests: int) -> Phases:
        # Two short requests first, so nothing lazy on the server's first request lands in the timed runs.
        warmup = [BenchRequest(r.prompt[:16], 2) for r in fresh_prompts(workload[:2], salt=1)]
        return cls(warmup, workload, fresh_prompts(workload[:single_requests], salt=2))


@dataclass(frozen=True)
class ServedRuns:
    saturated: RunResult
    single: RunResult


def check_exact(result: RunResult, requests: list[BenchRequest], label: str) -> None:
    """Raises unless every request completed with its exact prompt length and requested output length
    (as the server's usage reported them), so "output tokens" means the same work for every system."""
    for number, (record, request) in enumerate(zip(result.records, requests)):
        if not record.ok or record.prompt_tokens != len(request.prompt) or record.output_tokens != request.output_tokens:
            raise RuntimeError(
                f"{label}, request {number}: {record.error or 'completed'} with {record.prompt_tokens} prompt and "
                f"{record.output_tokens} output tokens; sent {len(request.prompt)}, asked for {request.output_tokens}"
            )


@dataclass(frozen=True)
class Session:
    """What the runs against every served system share."""

    phases: Phases
    served: ServedModel  # Sluice's model as served; llama.cpp computes on the same weights in the same arithmetic
    peaks: Peaks  # measured in served.arithmetic
    seed: int
    dataset: str
    command: str
    out: Path
    ready_timeout: float


def run_phases(
    url: str, session: Session, system: str, read_counters: Callable[[], llama_cpp.ServerCounters] | None = None
) -> ServedRuns:
    """Warm-up, saturation, one at a time against the server at `url`. With `read_counters` (llama-server),
    the server's own token counters must agree with what each phase sent and asked for."""
    phases, results = session.phases, []
    for phase, requests, max_concurrency in (
        ("warm-up", phases.warmup, None), ("saturation", phases.saturation, None), ("one at a time", phases.single, 1),
    ):
        load = LoadConfig(url, max_concurrency=max_concurrency, seed=session.seed)
        before = read_counters() if read_counters is not None else None
        result = benchmark(requests, load, Slo(), session.peaks, session.served)
        check_exact(result, requests, f"{system} {phase}")
        if read_counters is not None:
            llama_cpp.check_phase(read_counters() - before, requests, f"{system} {phase}")
        results.append(result)
    return ServedRuns(saturated=results[1], single=results[2])


def serve_and_run(
    session: Session, system: str, name: str, command: list[str], port: int,
    counters: Callable[[str], Callable[[], llama_cpp.ServerCounters]] | None = None,
) -> ServedRuns:
    """Starts the server, runs the phases against it, stops it; prints each timed run's report and writes
    its per-request record to `<out>/<name>_<phase>.json`."""
    url = f"http://127.0.0.1:{port}"
    with (session.out / f"{name}_server.log").open("w") as log:
        server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, server, session.ready_timeout)
            runs = run_phases(url, session, system, counters(url) if counters is not None else None)
        finally:
            server.terminate()
            server.wait(timeout=60)
    for phase, result in (("saturation", runs.saturated), ("single", runs.single)):
        print(f"\n{system}, {phase}:\n{report(result, session.command)}", flush=True)
        record = result_json(result, session.command, session.dataset)
        (session.out / f"{name}_{phase}.json").write_text(json.dumps(record, indent=2) + "\n")
    return runs


def held_back_tokens(runs: ServedRuns) -> int:
    """Output tokens that reached the client in a chunk with the next token rather than in their own."""
    return sum(r.output_tokens - len(r.chunk_times) for run in (runs.saturated, runs.single) for r in run.records)


def hf_baseline(args: argparse.Namespace, name: str, *options: str) -> dict:
    result_json = args.out / f"{name}.json"
    subprocess.run([str(args.hf_python), "-m", "bench.hf_baseline", *options, "--result-json", str(result_json)],
                   cwd=ROOT, check=True)
    return json.loads(result_json.read_text())


def hf_single_summary(hf: dict, requests: list[BenchRequest]) -> Summary:
    """HF's one-at-a-time run through the serving systems' definitions (bench.metrics)."""
    records = [
        RequestRecord(r["sent_at"], r["done_at"], tuple(r["token_times"]), (1,) * len(r["token_times"]),
                      r["prompt_tokens"], r["output_tokens"])
        for r in hf["records"]
    ]
    for record, request in zip(records, requests, strict=True):
        if len(record.chunk_times) != request.output_tokens:
            raise RuntimeError(f"HF one at a time: {len(record.chunk_times)} tokens for {request.output_tokens} asked")
    return summarize(records, hf["duration_s"])


def _row(system: str, out_tps: float, total_tps: float, duration_s: float, single: Summary | None, notes: str) -> str:
    latency = f"{single.ttft_ms.median:.0f} | {single.tpot_ms.median:.1f}" if single is not None else "- | -"
    return f"| {system} | {out_tps:.1f} | {total_tps:.1f} | {duration_s:.1f} | {latency} | {notes} |"


def _summary_row(system: str, saturated: Summary, single: Summary, notes: str) -> str:
    return _row(system, saturated.output_throughput, saturated.total_token_throughput, saturated.duration_s, single, notes)


def _relative(path: str) -> str:
    return os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else path


def main() -> int:
    parser = argparse.ArgumentParser(prog="python bench/compare.py", description=__doc__.split("\n\n")[0])
    add_dataset_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="Sluice's running batch (and llama-server's slots)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024,
                        help="Sluice's context limit; the default workload's longest request is 512 + 192 tokens")
    parser.add_argument("--kv-cache-memory", default=None, help="Sluice's KV pool, e.g. 512MiB (default: engine's)")
    parser.add_argument("--single-requests", type=int, default=8,
                        help="how many of the workload's requests the one-at-a-time run sends")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (-t)")
    parser.add_argument("--hf-python", type=Path, default=ROOT / ".venv-bench-ref/bin/python")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64],
                        help="static batch sizes the baseline runs at; the ratio is to the fastest")
    parser.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for a server")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/compare")
    args = parser.parse_args()
    command = shlex.join(["python", "bench/compare.py", *sys.argv[1:]])
    args.out.mkdir(parents=True, exist_ok=True)
    missing = [p for p in (args.hf_python, llama_cpp.BUILD_BIN / "llama-server", llama_cpp.BUILD_BIN / "llama-bench") if not p.exists()]
    if missing:
        print(f"missing {', '.join(map(str, missing))}; `make bench` builds them", file=sys.stderr)
        return 2

    served, hf_served = ServedModel.of(None, "float32", "auto"), ServedModel.of(None, "float32", "none")
    peaks = measure_peaks(dtype=served.arithmetic)
    hf_peaks = measure_peaks(dtype=hf_served.arithmetic)
    print(f"peaks: {peaks.bandwidth_gbs:.1f} GB/s, {peaks.matmul_gflops:.0f} G{served.arithmetic} ops/s, "
          f"{hf_peaks.matmul_gflops:.0f} G{hf_served.arithmetic} ops/s ({peaks.device})", flush=True)
    workload, dataset = load_dataset(args)
    phases = Phases.of(workload, args.single_requests)
    save_jsonl(phases.saturation, args.out / "workload.jsonl")
    save_jsonl(phases.single, args.out / "single.jsonl")
    gguf = resolve_model(None)

    session = Session(phases, served, peaks, args.seed, dataset, command, args.out, args.ready_timeout)
    port = free_port()
    sluice = serve_and_run(session, "Sluice", "sluice", sluice_command(port, args), port)

    port = free_port()
    llama_config = llama_cpp.ServerConfig(
        gguf, port, args.threads, args.max_num_seqs,
        llama_cpp.slot_context_for(phases.warmup + phases.saturation + phases.single),
    )
    llama_server_command = llama_cpp.server_command(llama_config)
    llama = serve_and_run(session, "llama.cpp", "llama_cpp", llama_server_command, port, llama_cpp.counters_reader)
    llama_bench_command = llama_cpp.bench_command(gguf, args.threads)
    llama_bench = llama_cpp.run_bench(llama_bench_command)
    print("llama-bench: " + ", ".join(f"{f.test} {f.tokens_per_s:.1f} ± {f.stddev:.1f} tok/s" for f in llama_bench), flush=True)

    hf_runs = []
    for batch_size in args.hf_batch_sizes:
        hf = hf_baseline(args, f"hf_baseline_b{batch_size}", "--workload", str(args.out / "workload.jsonl"), "--batch-size", str(batch_size))
        hf["roofline"] = asdict(workload_roofline(
            hf_served, hf_peaks,
            [len(r.prompt) for r in workload], [r.output_tokens for r in workload], batch_size,
        ))
        hf_runs.append(hf)
    best_hf = max(hf_runs, key=lambda hf: hf["output_throughput"])
    hf_single_run = hf_baseline(args, "hf_baseline_single", "--workload", str(args.out / "single.jsonl"), "--one-at-a-time")
    hf_single = hf_single_summary(hf_single_run, phases.single)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    sat, llama_sat = sluice.saturated.summary, llama.saturated.summary
    one, llama_one = sluice.single.summary, llama.single.summary
    table = [
        f"CPU comparison, {datetime.date.today().isoformat()}, commit {commit}; {dataset}",
        f"peaks measured: {peaks.bandwidth_gbs:.1f} GB/s memory, {peaks.matmul_gflops:.0f} G{served.arithmetic} ops/s "
        f"(Sluice's and llama.cpp's matmuls), {hf_peaks.matmul_gflops:.0f} GFLOP/s {hf_served.arithmetic} (HF's)",
        "",
        f"| system | saturation output tok/s | total tok/s | duration s | one at a time ({len(phases.single)} requests): "
        "TTFT p50 ms | TPOT p50 ms | notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        _summary_row(f"Sluice, continuous batching (max-num-seqs {args.max_num_seqs})", sat, one,
             f"saturation: TTFT p50 {sat.ttft_ms.median:.0f} ms, TPOT p50 {sat.tpot_ms.median:.0f} ms, "
             f"batch {sat.mean_decode_batch:.1f}, {held_back_tokens(sluice)} tokens held back, {sat.output_throughput / sluice.saturated.roofline.bound_output_tps:.1%} "
             f"of the roofline ({served.arithmetic} matmuls, {served.weight_bytes / 1e6:.0f} MB of weights)"),
        _summary_row(f"llama.cpp llama-server ({llama_config.parallel} slots, -t {llama_config.threads})", llama_sat, llama_one,
             f"saturation: TTFT p50 {llama_sat.ttft_ms.median:.0f} ms, TPOT p50 {llama_sat.tpot_ms.median:.0f} ms, "
             f"batch {llama_sat.mean_decode_batch:.1f}, {held_back_tokens(llama)} tokens held back; Q4_1 weights, f16 KV"),
        *(_row(
            f"HF transformers {hf['versions']['transformers']} static batch {hf['batch_size']}",
            hf["output_throughput"], hf["total_token_throughput"], hf["duration_s"], hf_single if hf is best_hf else None,
            f"{hf['generated_tokens']} tokens generated for {hf['output_tokens']} requested, "
            f"{hf['output_throughput'] / hf['roofline']['bound_output_tps']:.1%} of roofline at batch {hf['batch_size']}"
            + ("; TTFT/TPOT: each request alone at batch 1, timed in-process (no HTTP)" if hf is best_hf else ""),
        ) for hf in hf_runs),
        "",
        f"saturation output tok/s: Sluice / llama.cpp {sat.output_throughput / llama_sat.output_throughput:.2f}x, "
        f"Sluice / HF at its best batch size ({best_hf['batch_size']}) {sat.output_throughput / best_hf['output_throughput']:.2f}x",
        f"one at a time, p50: TTFT Sluice / llama.cpp {one.ttft_ms.median / llama_one.ttft_ms.median:.2f}x, "
        f"TPOT Sluice / llama.cpp {one.tpot_ms.median / llama_one.tpot_ms.median:.2f}x, "
        f"TTFT Sluice / HF {one.ttft_ms.median / hf_single.ttft_ms.median:.2f}x, "
        f"TPOT Sluice / HF {one.tpot_ms.median / hf_single.tpot_ms.median:.2f}x (below 1: Sluice faster)",
        "llama-bench: " + ", ".join(f"{f.test} {f.tokens_per_s:.1f} ± {f.stddev:.1f} tok/s" for f in llama_bench)
        + f" ({shlex.join(_relative(a) for a in llama_bench_command)})",
        f"llama-server: {shlex.join(_relative(a) for a in llama_server_command)}",
        sluice.saturated.roofline.line(sat.output_throughput),
        f"command: {command}",
    ]
    print("\n" + "\n".join(table))
    (args.out / "compare.json").write_text(json.dumps({
        "command": command,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "dataset": dataset,
        "peaks": asdict(peaks),
        "sluice_saturation": asdict(sat) | {"roofline": asdict(sluice.saturated.roofline)},
        "sluice_single": asdict(one) | {"roofline": asdict(sluice.single.roofline)},
        "llama_cpp_server": {"command": llama_server_command, "saturation": asdict(llama_sat), "single": asdict(llama_one)},
        "llama_bench": {"command": llama_bench_command, "figures": [asdict(f) for f in llama_bench]},
        "hf_static": hf_runs,
        "hf_single": asdict(hf_single),
        "table": table,
    }, indent=2) + "\n")
    print(f"results: {args.out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
