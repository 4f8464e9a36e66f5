"""`make bench`'s results and how they are shown: per weight format, each system's figures over the repetitions
(median and range), llama-server's sweep, the ratios, and the table and JSON (`bench/compare.py` runs it all).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sluice.bench import llama_cpp
from sluice.bench.metrics import Spread, Summary
from sluice.bench.roofline import ServedModel
from sluice.bench.serve import RunResult

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Format:
    """A weight format both systems serve from one GGUF file: llama.cpp computes on the file's type, Sluice
    converts it to its `--quantization` mode without loss (`model/quantize.py`)."""

    gguf_type: str
    quantization: str

    @property
    def label(self) -> str:
        return f"{self.gguf_type} (Sluice {self.quantization})"


FORMATS = {f.gguf_type: f for f in (Format("Q4_1", "int4"), Format("Q8_0", "int8"))}


@dataclass(frozen=True)
class ServedRuns:
    """One server's timed phases in one round."""

    saturated: RunResult
    single: RunResult

    @property
    def held_back_tokens(self) -> int:
        """Output tokens that reached the client in a chunk with the next token rather than in their own."""
        return sum(r.output_tokens - len(r.chunk_times) for run in (self.saturated, self.single) for r in run.records)


@dataclass(frozen=True)
class Figures:
    """One system's figures over the rounds of one format."""

    output_throughput: Spread  # saturation, tok/s
    total_token_throughput: Spread  # saturation, tok/s
    single_ttft_ms: Spread  # one at a time, p50
    single_tpot_ms: Spread  # one at a time, p50
    saturation_ttft_ms: Spread  # p50
    saturation_tpot_ms: Spread  # p50
    decode_batch: Spread  # saturation, mean
    held_back_tokens: Spread
    roofline_fraction: Spread  # saturation output tok/s over the roofline's bound

    @classmethod
    def of(cls, rounds: Sequence[ServedRuns]) -> Figures:
        def spread(figure: Callable[[ServedRuns], float]) -> Spread:
            return Spread.of([figure(r) for r in rounds])

        return cls(
            output_throughput=spread(lambda r: r.saturated.summary.output_throughput),
            total_token_throughput=spread(lambda r: r.saturated.summary.total_token_throughput),
            single_ttft_ms=spread(lambda r: r.single.summary.ttft_ms.median),
            single_tpot_ms=spread(lambda r: r.single.summary.tpot_ms.median),
            saturation_ttft_ms=spread(lambda r: r.saturated.summary.ttft_ms.median),
            saturation_tpot_ms=spread(lambda r: r.saturated.summary.tpot_ms.median),
            decode_batch=spread(lambda r: r.saturated.summary.mean_decode_batch),
            held_back_tokens=spread(lambda r: r.held_back_tokens),
            roofline_fraction=spread(
                lambda r: r.saturated.summary.output_throughput / r.saturated.roofline.bound_output_tps),
        )


@dataclass(frozen=True)
class FormatResult:
    """Everything one format's part of the run measured."""

    format: Format
    gguf: Path
    requantized_by: list[str] | None  # the llama-quantize command that wrote `gguf`; None: the fetched file
    served: ServedModel  # Sluice's model as served in this format
    sweep: list[llama_cpp.Measured]
    llama_config: llama_cpp.ServerConfig  # at the sweep's best setting
    sluice_command: list[str]
    llama_command: list[str]
    sluice: list[ServedRuns]  # one per round
    llama: list[ServedRuns]
    llama_bench_command: list[str]
    llama_bench: list[llama_cpp.BenchFigure]

    @property
    def best(self) -> llama_cpp.Measured:
        return llama_cpp.best(self.sweep)

    def ratio(self, figure: Callable[[ServedRuns], float]) -> Spread:
        """Sluice's figure over llama.cpp's in the same round, over the rounds."""
        return Spread.of([figure(s) / figure(l) for s, l in zip(self.sluice, self.llama, strict=True)])

    def ratios(self) -> dict[str, Spread]:
        return {
            "saturation_output_throughput": self.ratio(lambda r: r.saturated.summary.output_throughput),
            "single_ttft_p50": self.ratio(lambda r: r.single.summary.ttft_ms.median),
            "single_tpot_p50": self.ratio(lambda r: r.single.summary.tpot_ms.median),
        }


def relative(path: str | Path) -> str:
    path = str(path)
    return os.path.relpath(path, ROOT) if path.startswith(str(ROOT)) else path


def shown(command: Sequence[str | Path]) -> str:
    return shlex.join(relative(a) for a in command)


def row(fmt: str, system: str, figures: Figures, notes: str) -> str:
    f = figures
    return (f"| {fmt} | {system} | {f.output_throughput:.1f} | {f.total_token_throughput:.1f} | {f.single_ttft_ms:.0f} | "
            f"{f.single_tpot_ms:.1f} | {notes} |")


def format_rows(result: FormatResult, max_num_seqs: int) -> list[str]:
    sluice, llama = Figures.of(result.sluice), Figures.of(result.llama)
    fmt, config = result.format, result.llama_config
    return [
        row(fmt.label, f"Sluice, continuous batching (max-num-seqs {max_num_seqs})", sluice,
            f"saturation: TTFT p50 {sluice.saturation_ttft_ms.median:.0f} ms, TPOT p50 {sluice.saturation_tpot_ms.median:.0f} "
            f"ms, batch {sluice.decode_batch.median:.1f}, {sluice.held_back_tokens.median:.0f} tokens held back, "
            f"{sluice.roofline_fraction.median:.1%} of the roofline ({result.served.arithmetic} matmuls, "
            f"{result.served.weight_bytes / 1e6:.0f} MB of weights)"),
        row(fmt.gguf_type, f"llama.cpp llama-server `{config.setting.label}` -t {config.threads} "
            f"(best of {len(result.sweep)} settings)", llama,
            f"saturation: TTFT p50 {llama.saturation_ttft_ms.median:.0f} ms, TPOT p50 {llama.saturation_tpot_ms.median:.0f} "
            f"ms, batch {llama.decode_batch.median:.1f}, {llama.held_back_tokens.median:.0f} tokens held back; "
            f"{fmt.gguf_type} weights, f16 KV"),
    ]


def hf_row(hf: dict, single: Summary | None, source: str) -> str:
    latency = f"{single.ttft_ms.median:.0f} | {single.tpot_ms.median:.1f}" if single is not None else "- | -"
    notes = (f"one run; {hf['generated_tokens']} tokens generated for {hf['output_tokens']} requested, "
             f"{hf['output_throughput'] / hf['roofline']['bound_output_tps']:.1%} of roofline at batch {hf['batch_size']}")
    if single is not None:
        notes += "; TTFT/TPOT: each request alone at batch 1, timed in-process (no HTTP)"
    return (f"| {source} dequantized to float32 | HF transformers {hf['versions']['transformers']} static batch "
            f"{hf['batch_size']} | {hf['output_throughput']:.1f} | {hf['total_token_throughput']:.1f} | {latency} | {notes} |")


def sweep_table(sweeps: dict[str, Sequence[llama_cpp.Measured]]) -> list[str]:
    """llama-server's settings (rows) by format (columns) from {format: its sweep}, saturation output tok/s;
    each format's best in bold."""
    settings = list(dict.fromkeys(m.setting for sweep in sweeps.values() for m in sweep))
    cells = {(fmt, m.setting): m.output_throughput for fmt, sweep in sweeps.items() for m in sweep}
    best = {(fmt, llama_cpp.best(sweep).setting) for fmt, sweep in sweeps.items()}

    def cell(fmt: str, setting: llama_cpp.Setting) -> str:
        if (fmt, setting) not in cells:
            return "-"
        return f"**{cells[fmt, setting]:.1f}**" if (fmt, setting) in best else f"{cells[fmt, setting]:.1f}"

    return [
        "| llama-server setting | " + " | ".join(sweeps) + " |",
        "| --- |" + " --- |" * len(sweeps),
        *(f"| `{s.label}` | " + " | ".join(cell(fmt, s) for fmt in sweeps) + " |" for s in settings),
    ]


def times(ratio: Spread) -> str:
    return f"{ratio.median:.2f}x ({ratio.min:.2f}-{ratio.max:.2f})"


def ratio_line(result: FormatResult, best_hf: dict | None) -> str:
    """Sluice / llama.cpp per round (median, range), and Sluice's median over HF's best batch size."""
    ratios = result.ratios()
    line = (f"{result.format.label}, Sluice / llama.cpp in the same round: saturation output tok/s "
            f"{times(ratios['saturation_output_throughput'])}; one at a time p50 TTFT {times(ratios['single_ttft_p50'])}, "
            f"TPOT {times(ratios['single_tpot_p50'])} (below 1: Sluice faster)")
    if best_hf is not None:
        line += (f"; Sluice / HF at its best batch size ({best_hf['batch_size']}) "
                 f"{Figures.of(result.sluice).output_throughput.median / best_hf['output_throughput']:.2f}x")
    return line


def format_json(result: FormatResult) -> dict[str, Any]:
    def rounds(runs: Sequence[ServedRuns]) -> list[dict[str, Any]]:
        return [{"saturation": asdict(r.saturated.summary) | {"roofline": asdict(r.saturated.roofline)},
                 "single": asdict(r.single.summary) | {"roofline": asdict(r.single.roofline)}} for r in runs]

    return {
        "gguf": str(result.gguf),
        "requantized_by": result.requantized_by,
        "sluice_quantization": result.format.quantization,
        "sluice_weight_bytes": result.served.weight_bytes,
        "sluice": {"command": result.sluice_command, "figures": asdict(Figures.of(result.sluice)),
                   "rounds": rounds(result.sluice)},
        "llama_cpp_server": {"command": result.llama_command, "setting": result.best.setting.label,
                             "figures": asdict(Figures.of(result.llama)), "rounds": rounds(result.llama)},
        "llama_cpp_sweep": [{"setting": m.setting.label, "output_throughput": m.output_throughput} for m in result.sweep],
        "ratios": {name: asdict(spread) for name, spread in result.ratios().items()},
        "llama_bench": {"command": result.llama_bench_command, "figures": [asdict(f) for f in result.llama_bench]},
    }
