"""What serving LoRA adapters costs the engine: the same requests in three configurations, side by side.

    python -m sluice.bench.lora                                   # 64 requests at once, 128 prompt / 128 output tokens
    python -m sluice.bench.lora --concurrency 1 --repetitions 3   # one stream: its TPOT
    python -m sluice.bench.lora --adapters 8 --rank 64 --json bench/out/lora.json
    python -m sluice.bench.lora --adapters 8 --max-loras 2        # 8 adapters swapped through 2 device slots
    python -m sluice.bench.lora --adapters 8 --max-loras 2 --max-cpu-loras 2   # ... and read again from disk
    python -m sluice.bench.lora --model llama-3-8b --concurrency 256     # a GPU: random weights, real shapes

The model is the default GGUF (`sluice fetch`), or with `--model` one of bench.engine_check's models in random
weights of its real shapes (where no model file can go, as on the GPU machine). First, `--adapters` random PEFT LoRA adapters of rank `--rank` for the model's real shapes are written to a
temporary folder (`write_adapter`: adapter_config.json and adapter_model.safetensors as PEFT saves them, all seven
projections of every layer; small random weights, as speed does not depend on their values). Then `--concurrency`
requests of distinct random prompts (so the prefix cache gives nothing), greedy, EOS ignored, each `--output`
tokens, run offline in three configurations, each on an engine of its own over a freshly loaded model, warmed up
(compiled) before timing:
- no LoRA: the engine as it is without `enable_lora`;
- LoRA, base requests: `enable_lora` with the adapters on the device (`--max-loras` slots, vLLM's: the first
  adapters in them, the rest in host memory, or with `--max-cpu-loras` only that many there and the others read
  again from disk when swapped in; default a slot per adapter), every request on the base model (what LoRA costs
  requests that use none);
- LoRA, mixed: the same engine settings, the requests spread round-robin over the adapters (with fewer slots
  than adapters, a batch holds sequences of at most `--max-loras` adapters, the others waiting to be swapped in).
Timed: from the first submission to the last step (the loop of `Engine.generate`, with sinks that note when each
token arrived). Output tok/s is the output tokens over that time; a request's TPOT is the time from its first
token to its last over the tokens between. Each repetition runs the three once, in the reverse order of the
repetition before, so drift on the machine hits all alike; the report gives median (min-max) over repetitions,
and the ratio of each LoRA configuration to no LoRA within each repetition.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import Increment
from sluice.batching.sampling_params import LoraRequest, SamplingParams
from sluice.bench.dataset import FIRST_ORDINARY_TOKEN
from sluice.bench.engine_check import MODELS, random_model
from sluice.bench.kv_cache import cpu_name
from sluice.bench.metrics import Spread
from sluice.model.config import ModelConfig
from sluice.model.loader import LoadedModel, load_model
from sluice.model.quantize import resolve
from sluice.model.lora import CONFIG_FILE, MODULES, WEIGHTS_FILE
from sluice.model.weights import LAYER_TENSORS, expected_shape

CONFIGURATIONS = ("no LoRA", "LoRA, base requests", "LoRA, mixed")
B_SCALE = 0.01  # lora_B's spread: each adapter moves a projection's output by about this much, far from overflow


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """Writes to `folder` (created) a PEFT LoRA adapter of rank `rank` for `config`'s model on q/k/v/o_proj and
    gate/up/down_proj of every layer: adapter_config.json as PEFT writes it (lora_alpha 2 * rank) and
    adapter_model.safetensors, float32, lora_A `[r, in]` drawn N(0, 1 / in) and lora_B `[out, r]` N(0, B_SCALE^2 / r)
    from `seed`. Returns `folder`."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, weight in MODULES.items():
            out_features, in_features = expected_shape(weight, config)
            prefix = f"base_model.model.model.layers.{layer}.{LAYER_TENSORS[weight][1].removesuffix('.weight')}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, in_features**-0.5, (rank, in_features))
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, B_SCALE * rank**-0.5, (out_features, rank))
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
                "target_modules": list(MODULES), "bias": "none", "use_rslora": False, "use_dora": False,
                "fan_in_fan_out": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                "alpha_pattern": {}, "inference_mode": True}
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(json.dumps(settings, indent=2))
    save_file({key: t.astype(np.float32) for key, t in tensors.items()}, folder / WEIGHTS_FILE)
    return folder


@dataclass
class Arrivals:
    """An `OutputSink` that keeps only when each of one request's tokens arrived (`time.perf_counter()`)."""

    times: list[float] = field(default_factory=list)

    def put(self, increment: Increment) -> None:
        self.times += [time.perf_counter()] * len(increment.token_ids)

    @property
    def tpot(self) -> float | None:
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else None


@dataclass(frozen=True)
class Run:
    """One configuration's timed run: `output_tokens` over `seconds`, each request's TPOT (seconds) in `tpots`."""

    configuration: str
    output_tokens: int
    seconds: float
    tpots: tuple[float, ...]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tpot_ms(self) -> float:
        return 1e3 * statistics.median(self.tpots)


def timed_run(engine: Engine, configuration: str, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    """`prompts` run offline on `engine`, each with its `params`, as `Engine.generate` runs them, timed."""
    sinks = [Arrivals() for _ in prompts]
    start = time.perf_counter()
    for i, (prompt, p, sink) in enumerate(zip(prompts, params, sinks, strict=True)):
        engine.submit([prompt], p, sink, f"lora-bench-{i}")
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    return Run(configuration, sum(len(s.times) for s in sinks), seconds, tuple(t for s in sinks if (t := s.tpot)))


def request_params(configuration: str, adapters: list[LoraRequest], count: int, output: int) -> list[SamplingParams]:
    """Each request's parameters: greedy, `output` tokens, EOS ignored; in "LoRA, mixed" adapter i % N for request i."""
    greedy = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    if configuration != "LoRA, mixed":
        return [greedy] * count
    return [replace(greedy, lora=adapters[i % len(adapters)]) for i in range(count)]


def measure(configuration: str, config: EngineConfig, prompts: list[list[int]], args: argparse.Namespace) -> Run:
    """One run of `configuration` on an engine of its own, dropped after, over a freshly loaded model (an engine
    sets the LoRA weights of the model it is handed, in place)."""
    engine = Engine(loaded_model(args), config, progress=False)
    run = timed_run(engine, configuration, prompts,
                    request_params(configuration, list(engine.adapters.values()), len(prompts), args.output))
    del engine
    # The engine froze what it held (gc.freeze) to keep the collector's full passes short; unfrozen, its cycles go.
    gc.unfreeze()
    gc.collect()
    return run


def loaded_model(args: argparse.Namespace) -> LoadedModel:
    """A fresh copy of the model `--model` names: the default GGUF's, or random weights of a model's real shapes."""
    if args.model == "default":
        return load_model(quantization=args.quantization)
    return random_model(args.model, resolve(args.quantization))


def engine_configs(args: argparse.Namespace, modules: tuple[tuple[str, str], ...]) -> dict[str, EngineConfig]:
    """Each configuration's engine settings: the CPU's defaults but for a batch of `--concurrency` requests, and
    `--max-loras` LoRA slots (None: one per adapter) and `--max-cpu-loras` adapters in host memory (None: all)."""
    base = EngineConfig(quantization=args.quantization, max_num_seqs=args.concurrency,
                        max_model_len=args.prompt + args.output)
    lora = replace(base, enable_lora=True, lora_modules=modules, max_loras=args.max_loras,
                   max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.rank)
    return {"no LoRA": base, "LoRA, base requests": lora, "LoRA, mixed": lora}


def machine() -> dict[str, str | int]:
    return {"cpu": cpu_name(), "cpus": os.cpu_count() or 0, "jax": jax.__version__,
            "load_average": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "date": str(datetime.date.today())}


def summary(runs: list[Run]) -> dict[str, dict[str, Spread]]:
    """Per configuration: output tok/s and TPOT ms over repetitions, and the ratio of its tok/s to no LoRA's
    within each repetition."""
    by = {name: [r for r in runs if r.configuration == name] for name in CONFIGURATIONS}
    return {name: {"output_tok_s": Spread.of([r.output_tok_s for r in runs_]),
                   "tpot_ms": Spread.of([r.tpot_ms for r in runs_]),
                   "ratio": Spread.of([r.output_tok_s / a.output_tok_s for r, a in zip(runs_, by["no LoRA"])])}
            for name, runs_ in by.items()}


def table(figures: dict[str, dict[str, Spread]]) -> str:
    lines = ["| configuration | output tok/s | TPOT ms | / no LoRA |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {f['output_tok_s']:.1f} | {f['tpot_ms']:.2f} | {f['ratio']:.3f} |"
              for name, f in figures.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    command = shlex.join(["python", "-m", "sluice.bench.lora", *argv])
    rng = np.random.default_rng(args.seed)
    config = loaded_model(args).config
    prompts = [rng.integers(FIRST_ORDINARY_TOKEN, config.vocab_size, args.prompt).tolist()
               for _ in range(args.concurrency)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="sluice-lora-bench-") as folder:
        modules = tuple((f"bench-{i}", str(write_adapter(Path(folder) / f"bench-{i}", config, args.rank, seed=i)))
                        for i in range(args.adapters))
        configs = engine_configs(args, modules)
        for repetition in range(args.repetitions):
            for name in CONFIGURATIONS if repetition % 2 == 0 else reversed(CONFIGURATIONS):
                runs.append(measure(name, configs[name], prompts, args))
                print(f"repetition {repetition}, {name}: {runs[-1].output_tok_s:.1f} tok/s, TPOT "
                      f"{runs[-1].tpot_ms:.2f} ms", file=sys.stderr, flush=True)
    figures = summary(runs)
    host = machine()
    slots = "a slot per adapter" if args.max_loras is None else f"--max-loras {args.max_loras}"
    if args.max_cpu_loras is not None:
        slots += f", --max-cpu-loras {args.max_cpu_loras}"
    print(f"`{command}`: {args.model} model, {args.adapters} adapters of rank {args.rank} on all seven projections "
          f"({slots}), {args.concurrency} requests at once of {args.prompt} prompt / {args.output} output tokens, "
          f"--quantization {args.quantization}; median (min-max) of {args.repetitions} repetitions\n")
    print(table(figures))
    print(f"\n{host['cpu']} ({host['cpus']} CPUs), load average {host['load_average']} after the runs, "
          f"jax {host['jax']}, {host['date']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": command, "machine": host, "settings": vars(args),
            "figures": {name: {k: asdict(s) for k, s in f.items()} for name, f in figures.items()},
            "runs": [asdict(r) | {"output_tok_s": r.output_tok_s, "tpot_ms": r.tpot_ms} for r in runs]}, indent=2))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", choices=["default", *MODELS],
                        help="default: the default GGUF; else that model's real shapes in random weights")
    parser.add_argument("--adapters", type=int, default=4, help="LoRA adapters written and served")
    parser.add_argument("--max-loras", type=int, default=None, metavar="M",
                        help="the LoRA engines' device slots (vLLM's --max-loras); default: one per adapter")
    parser.add_argument("--max-cpu-loras", type=int, default=None, metavar="C",
                        help="adapters the LoRA engines keep in host memory (vLLM's --max-cpu-loras), the others "
                             "read again from disk when swapped in; default: all")
    parser.add_argument("--rank", type=int, default=16, help="each adapter's rank (vLLM's default max_lora_rank)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests submitted at once (max_num_seqs)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=128, help="output tokens per request")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    parser.add_argument("--quantization", default="auto", help="weights, as `sluice serve --quantization`")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the runs and figures here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run(parser.parse_args(argv), argv)


if __name__ == "__main__":
    raise SystemExit(main())
