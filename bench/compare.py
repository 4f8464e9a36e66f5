"""The CPU comparison in one command: Sluice against llama.cpp at its best and HF transformers, same workload.

For each weight format of --formats, both servers serve one GGUF file: Q4_1 is the default model as fetched
(Sluice `--quantization int4`), Q8_0 that file requantized by `llama-quantize --allow-requantize` (Sluice
`--quantization int8`; llama.cpp's x86 matrix code has a fast path for Q8_0, none for Q4_1).
1. Measures the machine's peaks (memory bandwidth, matmul rate) before anything else runs.
2. Per format, sweeps llama-server's settings: every combination of --llama-np, --llama-kvu, --llama-batch and
   --llama-cache-ram (`bench/llama_cpp.py` says what each does), each a fresh server, a short warm-up and one
   saturation run of the first --sweep-requests requests. The best is the highest output tok/s.
3. Per format, --repetitions rounds of Sluice and llama-server at its best setting, alternating which goes
   first: each server started afresh, a short warm-up, the workload at saturation (every request sent at
   once), then --single-requests of it one at a time (max concurrency 1) for TTFT and TPOT, with
   `bench/serve.py`'s load generator. Each phase's streamed usage and the server's own /metrics counters must
   both show every prompt token computed afresh and exactly the requested tokens generated
   (`bench/server_counters.py`). Then `llama-bench -p 128 -n 128` on the format's GGUF.
4. HF transformers (`bench/hf_baseline.py`, in `.venv-bench-ref`), once, float32 from the Q4_1 GGUF: static
   batches of each of --hf-batch-sizes, and the one-at-a-time requests alone at batch 1 (skipped with --no-hf).
Prints one table (median and min-max over the rounds, the sweep, the ratios, the commands) and writes it all
as JSON. Builds nothing itself: `make bench` builds both environments and llama.cpp first.
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python bench/compare.py` puts bench/, not the root, on the path

from sluice.bench import llama_cpp  # noqa: E402
from sluice.bench.compare_report import (  # noqa: E402
    FORMATS, Format, FormatResult, ServedRuns, format_json, format_rows, hf_row, ratio_line, relative, shown, sweep_table,
)
from sluice.bench.dataset import BenchRequest, fresh_prompts, save_jsonl  # noqa: E402
from sluice.bench.metrics import RequestRecord, Slo, Summary, summarize  # noqa: E402
from sluice.bench.roofline import Peaks, ServedModel, measure_peaks, workload_roofline  # noqa: E402
from sluice.bench.serve import LoadConfig, RunResult, add_dataset_arguments, benchmark, load_dataset, report, result_json  # noqa: E402
from sluice.bench.server_counters import ServerCounters, check_phase, parse_llama_server, parse_sluice, reader  # noqa: E402
from sluice.model.fetch import resolve_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    """Waits for `server`'s /health to answer 200, asking every 0.2 s: a run starting a server per policy or per life
    (`bench routing`, the soak test) would lose up to a second at each start to a coarser poll."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{server.args[0]} exited with {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{server.args[0]} not ready after {timeout_s:.0f} s")


def sluice_command(port: int, gguf: Path, quantization: str, args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "sluice.app.cli", "serve", "--model", str(gguf), "--quantization", quantization,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len), "--log-level", "warning",
    ]
    if args.kv_cache_memory is not None:
        command += ["--kv-cache-memory", args.kv_cache_memory]
    return command


@dataclass(frozen=True)
class Phase:
    name: str
    requests: list[BenchRequest]
    max_concurrency: int | None = None  # None: every request sent at once


@dataclass(frozen=True)
class Phases:
    """The requests of each run against a server. Every phase has token ids of its own, so none is served
    from the prefix cache a previous phase filled; every system sees these same requests."""

    warmup: Phase
    saturation: Phase
    single: Phase
    sweep: Phase

    @classmethod
    def of(cls, workload: list[BenchRequest], single_requests: int, sweep_requests: int) -> Phases:
        # Two short requests first, so nothing lazy on the server's first request lands in the timed runs.
        warmup = [BenchRequest(r.prompt[:16], 2) for r in fresh_prompts(workload[:2], salt=1)]
        return cls(
            Phase("warm-up", warmup), Phase("saturation", workload),
            Phase("one at a time", fresh_prompts(workload[:single_requests], salt=2), max_concurrency=1),
            Phase("sweep", fresh_prompts(workload[:sweep_requests], salt=3)),
        )

    def all_requests(self) -> list[BenchRequest]:
        return [r for phase in (self.warmup, self.saturation, self.single, self.sweep) for r in phase.requests]


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
    """What the runs of one format share."""

    phases: Phases
    served: ServedModel  # Sluice's model as served; llama.cpp computes on the same weights in the same arithmetic
    peaks: Peaks  # measured in served.arithmetic
    seed: int
    dataset: str
    command: str
    out: Path
    ready_timeout: float


@dataclass(frozen=True)
class Server:
    """A server to start for one run: its name in reports, its name in file names, how to start it on a port,
    and how to read its token counters."""

    system: str
    name: str
    command: Callable[[int], list[str]]
    parse_counters: Callable[[str], ServerCounters]


def run_phases(url: str, session: Session, label: str, phases: Sequence[Phase],
               read_counters: Callable[[], ServerCounters]) -> list[RunResult]:
    """The phases in order against the server at `url`; the server's own counters must agree with what each
    phase sent and asked for."""
    results = []
    for phase in phases:
        load = LoadConfig(url, max_concurrency=phase.max_concurrency, seed=session.seed)
        before = read_counters()
        result = benchmark(phase.requests, load, Slo(), session.peaks, session.served)
        check_exact(result, phase.requests, f"{label} {phase.name}")
        check_phase(read_counters() - before, phase.requests, f"{label} {phase.name}")
        results.append(result)
    return results


def serve_and_run(session: Session, server: Server, phases: Sequence[Phase]) -> list[RunResult]:
    """Starts the server, runs the warm-up and `phases` against it, stops it; writes each of `phases`' per-request
    record to `<out>/<name>_<phase>.json` and returns their results."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (session.out / f"{server.name}_server.log").open("w") as log:
        process = subprocess.Popen(server.command(port), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, process, session.ready_timeout)
            results = run_phases(url, session, server.system, [session.phases.warmup, *phases],
                                 reader(url, server.parse_counters))[1:]
        finally:
            process.terminate()
            process.wait(timeout=60)
    for phase, result in zip(phases, results):
        record = result_json(result, session.command, session.dataset)
        (session.out / f"{server.name}_{phase.name.replace(' ', '_')}.json").write_text(json.dumps(record, indent=2) + "\n")
    return results


def served_runs(session: Session, server: Server) -> ServedRuns:
    saturated, single = serve_and_run(session, server, [session.phases.saturation, session.phases.single])
    for phase, result in (("saturation", saturated), ("one at a time", single)):
        print(f"\n{server.system}, {phase}:\n{report(result, session.command)}", flush=True)
    return ServedRuns(saturated, single)


def round_order(round_index: int) -> tuple[str, str]:
    """Which system goes first alternates from round to round (counted over all formats)."""
    return ("Sluice", "llama.cpp") if round_index % 2 == 0 else ("llama.cpp", "Sluice")


def llama_server(config: llama_cpp.ServerConfig, system: str, name: str) -> Server:
    return Server(system, name, lambda port: llama_cpp.server_command(replace(config, port=port)), parse_llama_server)


def sweep_llama_server(session: Session, gguf: Path, settings: Sequence[llama_cpp.Setting], threads: int,
                       slot_context: int) -> list[llama_cpp.Measured]:
    """Each setting's saturation output tok/s on the sweep phase, one fresh server each."""
    measured = []
    for number, setting in enumerate(settings):
        config = llama_cpp.ServerConfig(gguf, 0, threads, setting, slot_context)
        (result,) = serve_and_run(session, llama_server(config, f"llama.cpp `{setting.label}`", f"sweep_{number}"),
                                  [session.phases.sweep])
        measured.append(llama_cpp.Measured(setting, result.summary.output_throughput))
        print(f"llama-server sweep {number + 1}/{len(settings)}, `{setting.label}`: "
              f"{result.summary.output_throughput:.1f} output tok/s", flush=True)
    return measured


def format_gguf(fmt: Format, source: Path) -> tuple[Path, list[str] | None]:
    """The GGUF both systems serve in `fmt`: `source` itself when it is in that type, else requantized."""
    if source.stem.endswith("." + fmt.gguf_type):
        return source, None
    return llama_cpp.requantize(source, fmt.gguf_type)


def run_format(session: Session, fmt: Format, gguf: Path, requantized_by: list[str] | None,
               args: argparse.Namespace, first_round: int) -> FormatResult:
    slot_context = llama_cpp.slot_context_for(session.phases.all_requests())
    sweep = sweep_llama_server(session, gguf, args.llama_settings, args.threads, slot_context)
    config = llama_cpp.ServerConfig(gguf, 0, args.threads, llama_cpp.best(sweep).setting, slot_context)
    print(f"\n{fmt.label}: llama-server's best setting `{config.setting.label}`", flush=True)
    sluice_at = partial(sluice_command, gguf=gguf, quantization=fmt.quantization, args=args)
    runs: dict[str, list[ServedRuns]] = {"Sluice": [], "llama.cpp": []}
    for repetition in range(args.repetitions):
        servers = {
            "Sluice": Server("Sluice", f"sluice_r{repetition + 1}", sluice_at, parse_sluice),
            "llama.cpp": llama_server(config, "llama.cpp", f"llama_cpp_r{repetition + 1}"),
        }
        for system in round_order(first_round + repetition):
            print(f"\n{fmt.label}, round {repetition + 1}/{args.repetitions}: {system}", flush=True)
            runs[system].append(served_runs(session, servers[system]))
    bench_command = llama_cpp.bench_command(gguf, args.threads)
    llama_bench = llama_cpp.run_bench(bench_command)
    return FormatResult(fmt, gguf, requantized_by, session.served, sweep, config, sluice_at(0),
                        llama_cpp.server_command(config), runs["Sluice"], runs["llama.cpp"], bench_command, llama_bench)


def hf_baseline(args: argparse.Namespace, name: str, *options: str) -> dict:
    result_json = args.out / f"{name}.json"
    subprocess.run([str(args.hf_python), "-m", "sluice.bench.hf_baseline", *options, "--result-json", str(result_json)],
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


def run_hf(args: argparse.Namespace, phases: Phases, peaks: Peaks) -> tuple[list[dict], Summary]:
    """HF's static batches of each size over the workload, and its one-at-a-time run."""
    served = ServedModel.of(None, "float32", "none")
    workload = phases.saturation.requests
    runs = []
    for batch_size in args.hf_batch_sizes:
        hf = hf_baseline(args, f"hf_baseline_b{batch_size}", "--workload", str(args.out / "workload.jsonl"),
                         "--batch-size", str(batch_size))
        hf["roofline"] = asdict(workload_roofline(
            served, peaks, [len(r.prompt) for r in workload], [r.output_tokens for r in workload], batch_size,
        ))
        runs.append(hf)
    single = hf_baseline(args, "hf_baseline_single", "--workload", str(args.out / "single.jsonl"), "--one-at-a-time")
    return runs, hf_single_summary(single, phases.single.requests)


def _kv_unified(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r}: on or off")
    return text == "on"


def _or_default(text: str) -> int | None:
    return None if text == "default" else int(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python bench/compare.py", description=__doc__.split("\n\n")[0])
    add_dataset_arguments(parser)
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS),
                        help="weight formats, each served by both systems from the same GGUF")
    parser.add_argument("--repetitions", type=int, default=3,
                        help="rounds of Sluice and llama.cpp per format, alternating which goes first")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="Sluice's running batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024,
                        help="Sluice's context limit; the default workload's longest request is 512 + 192 tokens")
    parser.add_argument("--kv-cache-memory", default=None, help="Sluice's KV pool, e.g. 512MiB (default: engine's)")
    parser.add_argument("--single-requests", type=int, default=8,
                        help="how many of the workload's requests the one-at-a-time run sends")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (-t)")
    parser.add_argument("--llama-np", type=int, nargs="+", default=[16, 32, 64], help="sweep: llama-server's -np")
    parser.add_argument("--llama-kvu", type=_kv_unified, nargs="+", default=[False, True],
                        help="sweep: llama-server's -kvu (on) or -no-kvu (off)")
    parser.add_argument("--llama-batch", type=_or_default, nargs="+", default=[None, 512],
                        help="sweep: llama-server's -b and -ub ('default': 2048 and 512)")
    parser.add_argument("--llama-cache-ram", type=_or_default, nargs="+", default=[None, 0],
                        help="sweep: llama-server's --cache-ram in MiB ('default': 8192; 0 turns it off)")
    parser.add_argument("--sweep-requests", type=int, default=None,
                        help="how many of the workload's requests each sweep run sends at once (default: all)")
    parser.add_argument("--no-hf", action="store_true", help="leave HF transformers out")
    parser.add_argument("--hf-python", type=Path, default=ROOT / ".venv-bench-ref/bin/python")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64],
                        help="static batch sizes the baseline runs at; the ratio is to the fastest")
    parser.add_argument("--ready-timeout", type=float, default=1200.0, help="seconds to wait for a server")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/compare")
    args = parser.parse_args(argv)
    args.llama_settings = llama_cpp.sweep_settings(args.llama_np, args.llama_kvu, args.llama_batch, args.llama_cache_ram)
    return args


def main() -> int:
    args = parse_args()
    command = shlex.join(["python", "bench/compare.py", *sys.argv[1:]])
    binaries = [llama_cpp.BUILD_BIN / b for b in ("llama-server", "llama-bench", "llama-quantize")]
    missing = [p for p in (*binaries, *([] if args.no_hf else [args.hf_python])) if not p.exists()]
    if missing:
        print(f"missing {', '.join(map(str, missing))}; `make bench` builds them", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)

    source = resolve_model(None)
    formats = [FORMATS[name] for name in args.formats]
    files = {fmt.gguf_type: format_gguf(fmt, source) for fmt in formats}
    served = {fmt.gguf_type: ServedModel.of(str(files[fmt.gguf_type][0]), "float32", fmt.quantization) for fmt in formats}
    peaks = {dtype: measure_peaks(dtype=dtype) for dtype in sorted({s.arithmetic for s in served.values()} | {"float32"})}
    print("peaks: " + ", ".join(f"{p.matmul_gflops:.0f} G{dtype} ops/s" for dtype, p in peaks.items())
          + f", {peaks['float32'].bandwidth_gbs:.1f} GB/s ({peaks['float32'].device})", flush=True)
    workload, dataset = load_dataset(args)
    phases = Phases.of(workload, args.single_requests, args.sweep_requests or len(workload))
    save_jsonl(phases.saturation.requests, args.out / "workload.jsonl")
    save_jsonl(phases.single.requests, args.out / "single.jsonl")

    results = []
    for number, fmt in enumerate(formats):
        model = served[fmt.gguf_type]
        session = Session(phases, model, peaks[model.arithmetic], args.seed, dataset, command,
                          args.out / fmt.gguf_type, args.ready_timeout)
        session.out.mkdir(exist_ok=True)
        results.append(run_format(session, fmt, *files[fmt.gguf_type], args, number * args.repetitions))
    hf_runs, hf_single = ([], None) if args.no_hf else run_hf(args, phases, peaks["float32"])
    best_hf = max(hf_runs, key=lambda hf: hf["output_throughput"]) if hf_runs else None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    table = [
        f"CPU comparison, {datetime.date.today().isoformat()}, commit {commit}; {dataset}",
        f"Sluice and llama.cpp: rounds per format {args.repetitions}, each server started afresh, alternating which "
        "goes first; figures are the median (min-max) over the rounds",
        "peaks measured: " + ", ".join(f"{p.matmul_gflops:.0f} G{dtype} ops/s" for dtype, p in peaks.items())
        + f", {peaks['float32'].bandwidth_gbs:.1f} GB/s memory",
        "",
        f"| format | system | saturation output tok/s | total tok/s | one at a time ({len(phases.single.requests)} requests): "
        "TTFT p50 ms | TPOT p50 ms | notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(line for result in results for line in format_rows(result, args.max_num_seqs)),
        *(hf_row(hf, hf_single if hf is best_hf else None, source.stem.split(".")[-1]) for hf in hf_runs),
        "",
        f"llama-server's settings, saturation output tok/s of one run each ({len(phases.sweep.requests)} requests at once; "
        "the best, in bold, served the rounds above):",
        "",
        *sweep_table({r.format.gguf_type: r.sweep for r in results}),
        "",
        *(ratio_line(result, best_hf) for result in results),
        *(f"{r.format.gguf_type} llama-bench: " + ", ".join(f"{f.test} {f.tokens_per_s:.1f} ± {f.stddev:.1f} tok/s"
                                                             for f in r.llama_bench) + f" ({shown(r.llama_bench_command)})"
          for r in results),
        *(f"{r.format.gguf_type} llama-server: {shown(r.llama_command)} (port: a free one per run)" for r in results),
        *(f"{r.format.gguf_type} file: {relative(r.gguf)}"
          + (f", written by {shown(r.requantized_by)}" if r.requantized_by else "") for r in results),
        *(f"{r.format.gguf_type} Sluice, round 1 " + r.sluice[0].saturated.roofline.line(r.sluice[0].saturated.summary.output_throughput)
          for r in results),
        f"command: {command}",
    ]
    print("\n" + "\n".join(table))
    (args.out / "compare.json").write_text(json.dumps({
        "command": command,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "dataset": dataset,
        "repetitions": args.repetitions,
        "peaks": {dtype: asdict(p) for dtype, p in peaks.items()},
        "formats": {r.format.gguf_type: format_json(r) for r in results},
        "hf_static": hf_runs,
        "hf_single": asdict(hf_single) if hf_single is not None else None,
        "table": table,
    }, indent=2) + "\n")
    print(f"results: {args.out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
