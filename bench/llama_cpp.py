"""llama.cpp, the CPU peer of `make bench`: where it is built, llama-server's settings, command line and
the sweep over them, the requantized GGUF, llama-bench's figures.

`make bench` builds `llama-server`, `llama-bench` and `llama-quantize` once into `.llama-cpp/build/bin` from
the llama.cpp sources vendored in the llama-cpp-python sdist (see the Makefile). The comparison serves each
format's GGUF with `llama-server -t 2 -np N -c C` and the sweep's other flags (C: N slots of the workload's
longest request), and sends it the same requests as Sluice through the same load generator (`bench/serve.py`).

The settings swept, each a documented trade-off of llama-server on a CPU:
- `-np` (slots): how many requests decode together; more slots, larger batches but more KV memory.
- `-kvu` (one KV buffer for all slots): without it, an explicit `-np` gives each slot a KV stream of its own,
  and a step is split into micro-batches of consecutive slots with equal token counts (`split_equal`), so a
  step whose slots have gaps or mix prompt chunks with decodes runs as several.
- `-b`/`-ub` (logical/physical batch, default 2048/512): with the default `-b`, a step may take 2048 prompt
  tokens, and every decode in the batch waits for them.
- `--cache-ram` (default 8192 MiB): idle slots are copied to a host-memory prompt cache; `0` turns that off.
  Every phase's prompts are fresh token ids (`bench/server_counters.py` proves nothing is reused), so the copy
  is pure cost.

Its per-slot context is the total `-c` divided by `-np` (the whole `-c` with `-kvu`), rounded up to a
multiple of 256, so `-c` holds `-np` of the longest request either way.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.bench.dataset import BenchRequest

ROOT = Path(__file__).resolve().parent.parent
BUILD_BIN = ROOT / ".llama-cpp/build/bin"
REQUANTIZED = ROOT / ".llama-cpp/models"
# llama.cpp pads each slot's context up to a multiple of this many tokens.
CONTEXT_PADDING = 256


@dataclass(frozen=True)
class Setting:
    """One llama-server configuration of the sweep; None: llama-server's default."""

    parallel: int = 64  # -np
    kv_unified: bool = False  # -kvu / -no-kvu
    batch: int | None = None  # -b and -ub
    cache_ram_mib: int | None = None  # --cache-ram

    def args(self) -> list[str]:
        args = ["-np", str(self.parallel), "-kvu" if self.kv_unified else "-no-kvu"]
        if self.batch is not None:
            args += ["-b", str(self.batch), "-ub", str(self.batch)]
        if self.cache_ram_mib is not None:
            args += ["--cache-ram", str(self.cache_ram_mib)]
        return args

    @property
    def label(self) -> str:
        """The setting as its flags: `-np 64 -kvu -b 512 -ub 512 --cache-ram 0`."""
        return " ".join(self.args())


def sweep_settings(
    parallel: Sequence[int], kv_unified: Sequence[bool], batch: Sequence[int | None], cache_ram_mib: Sequence[int | None]
) -> list[Setting]:
    """Every combination of the values given for each flag."""
    return [Setting(*values) for values in itertools.product(parallel, kv_unified, batch, cache_ram_mib)]


@dataclass(frozen=True)
class Measured:
    """A setting and the saturation output tok/s its sweep run reached."""

    setting: Setting
    output_throughput: float


def best(sweep: Sequence[Measured]) -> Measured:
    """The setting with the highest saturation output tok/s (the first of equals)."""
    return max(sweep, key=lambda m: m.output_throughput)


@dataclass(frozen=True)
class ServerConfig:
    model: Path
    port: int
    threads: int = 2
    setting: Setting = Setting()
    slot_context: int = 1024

    @property
    def context(self) -> int:
        """The total `-c`: every slot can hold `slot_context` tokens at once."""
        return self.setting.parallel * self.slot_context


def slot_context_for(requests: Sequence[BenchRequest]) -> int:
    """Tokens one slot needs for the longest request (prompt + output), padded as llama.cpp pads it."""
    longest = max(len(r.prompt) + r.output_tokens for r in requests)
    return math.ceil(longest / CONTEXT_PADDING) * CONTEXT_PADDING


def server_command(config: ServerConfig, binary: Path = BUILD_BIN / "llama-server") -> list[str]:
    """llama-server with continuous batching as `config.setting` says, and /metrics for the token counters."""
    return [
        str(binary), "-m", str(config.model), "-t", str(config.threads), *config.setting.args(),
        "-c", str(config.context), "--host", "127.0.0.1", "--port", str(config.port), "--metrics",
    ]


def requantized_path(source: Path, gguf_type: str, folder: Path = REQUANTIZED) -> Path:
    """Where `requantize` writes `source` in `gguf_type`: `SmolLM2-135M-Instruct.Q4_1.Q8_0.gguf`."""
    return folder / f"{source.stem}.{gguf_type}.gguf"


def quantize_command(source: Path, target: Path, gguf_type: str, binary: Path = BUILD_BIN / "llama-quantize") -> list[str]:
    """`llama-quantize` from an already quantized GGUF: each tensor dequantized, then quantized to `gguf_type`."""
    return [str(binary), "--allow-requantize", str(source), str(target), gguf_type]


def requantize(source: Path, gguf_type: str) -> tuple[Path, list[str]]:
    """`source` in `gguf_type`, written once beside the build: the file and the command that wrote it."""
    target = requantized_path(source, gguf_type)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        subprocess.run(quantize_command(source, partial, gguf_type), capture_output=True, text=True, check=True)
        partial.rename(target)
    return target, quantize_command(source, target, gguf_type)


@dataclass(frozen=True)
class BenchFigure:
    """One llama-bench test: `pp128` (prompt processing of 128 tokens) or `tg128` (generating 128)."""

    test: str
    tokens_per_s: float
    stddev: float


def bench_command(
    model: Path, threads: int = 2, prompt_tokens: int = 128, gen_tokens: int = 128, binary: Path = BUILD_BIN / "llama-bench"
) -> list[str]:
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt_tokens), "-n", str(gen_tokens), "-o", "json"]


def parse_bench_json(text: str) -> list[BenchFigure]:
    """llama-bench's `-o json` output: one entry per test, with prompt (`n_prompt`) and generated (`n_gen`)
    token counts and the mean and standard deviation of tokens/s over its repetitions."""
    figures = []
    for entry in json.loads(text):
        test = "+".join(f"{kind}{n}" for kind, n in (("pp", entry["n_prompt"]), ("tg", entry["n_gen"])) if n)
        figures.append(BenchFigure(test, float(entry["avg_ts"]), float(entry["stddev_ts"])))
    return figures


def run_bench(command: list[str]) -> list[BenchFigure]:
    return parse_bench_json(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
