"""`sluice bench sweep`: `bench serve` over a list of request rates against one server, then the
throughput-latency curve. Each rate replays the same seeded lengths with fresh token-id prompts (so no
rate is served from the prefix cache an earlier one filled); peaks are measured once."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sluice.bench.dataset import fresh_prompts
from sluice.bench.metrics import Slo
from sluice.bench.plots import plot_rate_curves, plot_throughput_latency
from sluice.bench.roofline import ServedModel, peaks_from
from sluice.bench.serve import add_dataset_arguments, add_server_arguments, benchmark, command_line, load_config, load_dataset, report, request_rate, \
    result_json


def _rates(text: str) -> list[float]:
    return [request_rate(r.strip()) for r in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_dataset_arguments(parser)
    parser.add_argument("--request-rates", type=_rates, default=_rates("0.5,1,2,4,inf"),
                        help="comma-separated req/s; 'inf' sends every request at once")
    parser.add_argument("--out", type=Path, default=Path("bench/out/sweep"), help="folder for JSON and PNGs")


def run(args: argparse.Namespace) -> int:
    command = command_line()
    requests, dataset = load_dataset(args)
    served = ServedModel.of(args.roofline_model, args.dtype, args.quantization, args.kv_cache_dtype)
    peaks = peaks_from(args.peaks, served.arithmetic)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    print(f"dataset: {dataset}\npeaks: {peaks.bandwidth_gbs:.1f} GB/s, {peaks.matmul_gflops:.0f} GFLOP/s ({peaks.device})")
    args.out.mkdir(parents=True, exist_ok=True)
    results, failed = [], 0
    for index, rate in enumerate(args.request_rates):
        result = benchmark(fresh_prompts(requests, salt=index), load_config(args, rate), slo, peaks, served)
        print(f"\n--- request rate {rate:g} req/s ---\n{report(result, command)}")
        results.append(result_json(result, command, dataset))
        failed += result.summary.failed
    (args.out / "sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    paths = plot_rate_curves(results, args.out) + [plot_throughput_latency(results, args.out / "throughput_latency.png")]
    print(f"\n{'rate':>6} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    for r in results:
        s = r["summary"]
        print(f"{str(r['load']['request_rate']):>6} {s['output_throughput']:>10.1f} {s['ttft_ms']['median']:>9.1f} "
              f"{s['tpot_ms']['median']:>9.1f} {s['tpot_ms']['p99']:>9.1f}")
    print(f"command: {command}\nresults: {args.out / 'sweep.json'}\nplots: {', '.join(str(p) for p in paths)}")
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice bench sweep", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
