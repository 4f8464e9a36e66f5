"""Host work per decode step of the real engine, by phase, and how much of it overlap hides.

    python -m sluice.bench.host_overhead                                   # batches 1, 64, 256, 512; vocab 49,152 and 128,256
    python -m sluice.bench.host_overhead --batches 1,4,16,64 --model default              # the real model's device step
    python -m sluice.bench.host_overhead --batches 1,4,16,64 --model default --device-cores 1   # host on its own core
    python -m sluice.bench.host_overhead --batches 16,64 --model default --device-cores 1 --constrained 0.25

The model is small (random weights, two layers and hidden size 64 by default) with a real vocabulary (a
file-free word-level tokenizer of that size), so its step is short next to the host's work; the sampler still
scores the whole vocabulary. B requests decode together (greedy, EOS ignored), once with overlapped scheduling
and once without, and the steady decode phase is timed by phase: schedule, inputs (building the step's
arrays), dispatch, collect (turning the fetched arrays into each sequence's tokens), append (tokens onto
sequences, stop ids, max_tokens) and emit (detokenize, stop strings, delivery). Host work is the phases' sum;
wait is the time the host blocks on the device. Without overlap a step's period is about host + device; with
it, about max(host, device): `--layers`/`--hidden`, or `--model default` (the real SmolLM2, its step a few
milliseconds on a CPU), make the device step longer to show it. On a CPU the "device" is the host's own cores,
so overlap can only hide host work where the device leaves a core idle: `--device-cores` keeps XLA's threads
off one core (or more) for the engine's thread, as on a GPU. `--constrained` puts a share of each batch under a
grammar, whose masks the host fills each step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from flax import nnx

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import ListCollector
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.bench.engine_check import file_free_tokenizer
from sluice.bench.host_phases import PHASES, PhaseTimer
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel, load_model

PROMPT_TOKENS = 8


@dataclass(frozen=True)
class Measured:
    """Per decode step, in milliseconds: each host phase, the time spent waiting for the device, all host work
    (the phases' sum), and the step period (wall time per decode step)."""

    phases: dict[str, float]
    wait_ms: float
    host_ms: float
    period_ms: float
    cpu_ms: float


def tiny_model(vocab_size: int, num_layers: int, hidden: int) -> LoadedModel:
    """Random weights. At least two layers: a one-layer scan lets XLA copy the whole KV pool every step."""
    config = ModelConfig.tiny(vocab_size=vocab_size, num_layers=num_layers, hidden_size=hidden,
                              intermediate_size=2 * hidden, max_position_embeddings=4096)
    model = Llama(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    return LoadedModel(config=config, model=model, tokenizer=file_free_tokenizer(config), name="host-overhead")


def measure(engine: Engine, batch: int, decode_steps: int, constrained: float = 0.0) -> Measured:
    """Runs `batch` requests to their end, timing the steps in which all of them decode; the first `constrained`
    of them (a fraction) under a grammar that any lowercase text meets."""
    params = SamplingParams(max_tokens=decode_steps + 6 * engine.config.num_decode_steps, temperature=0.0,
                            ignore_eos=True)
    grammar = replace(params, structured=StructuredOutput("regex", "[a-z ]+"))
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 3 for j in range(PROMPT_TOKENS)]
        engine.submit([prompt], grammar if i < constrained * batch else params, ListCollector(1), f"host-{i}")
    while engine.stats.generation_tokens_total < batch:  # prefill and first tokens
        engine.step()
    for _ in range(2):
        engine.step()
    timer = PhaseTimer(engine)
    generated = engine.stats.generation_tokens_total
    start = time.perf_counter()
    while engine.stats.generation_tokens_total - generated < decode_steps * batch:
        engine.step()
    wall = time.perf_counter() - start
    timer.close()
    steps = (engine.stats.generation_tokens_total - generated) / batch
    while engine.has_work:
        engine.step()
    ms = timer.per_step_ms(steps)
    phases = {phase: ms[phase] for phase in PHASES}
    return Measured(phases, ms["wait"], sum(phases.values()), 1e3 * wall / steps, ms["cpu"])


def give_device_cores(num_cores: int) -> None:
    """Keeps XLA's CPU threads on the last `num_cores` cores, leaving the others to the engine's Python thread, as
    a GPU's host keeps its CPU to itself. XLA sizes its CPU client's thread pool from the process's affinity when
    it creates the client, and the threads it starts then keep that affinity; only this thread is unpinned after.
    So it must run before anything creates that client (first thing in `main`)."""
    cores = sorted(os.sched_getaffinity(0))
    if not 0 < num_cores < len(cores):
        raise SystemExit(f"--device-cores must leave the host a core: 1 to {len(cores) - 1} on this machine")
    os.sched_setaffinity(0, cores[-num_cores:])
    jax.devices()
    os.sched_setaffinity(0, cores)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.host_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256,512")
    parser.add_argument("--vocab", default="49152,128256")
    parser.add_argument("--model", help="a real model instead ('default': SmolLM2-135M; weights quantized as the "
                        "server's --quantization auto picks); --vocab, --layers and --hidden then do not apply")
    parser.add_argument("--layers", type=int, default=2, help="model layers (more: a longer device step)")
    parser.add_argument("--hidden", type=int, default=64, help="model hidden size")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per batch and mode")
    parser.add_argument("--num-decode-steps", type=int, default=1, help="the engine's decode steps per call")
    parser.add_argument("--constrained", type=float, default=0.0,
                        help="the fraction of each batch under a grammar (needs --model: llguidance reads its "
                             "tokenizer)")
    parser.add_argument("--device-cores", type=int, default=None,
                        help="CPU only: XLA's threads on this many cores, the engine's thread on the others (default: "
                             "all share every core)")
    args = parser.parse_args(argv)
    if args.constrained and not args.model:
        parser.error("--constrained needs --model")
    if args.device_cores is not None:
        give_device_cores(args.device_cores)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"python -m sluice.bench.host_overhead {' '.join(argv if argv is not None else sys.argv[1:])}")
    shape = f"model {args.model}" if args.model else f"{args.layers} layers, hidden {args.hidden}"
    print(f"ms per decode step; {shape}, {args.num_decode_steps} decode steps per call; host = the phases' sum, "
          "wait = blocked on the device, period = wall time per step, cpu = the engine thread's CPU time per step")
    print(f"{'vocab':>7} {'batch':>5} {'overlap':>7} " + " ".join(f"{p:>8}" for p in PHASES)
          + f" {'host':>8} {'wait':>8} {'period':>8} {'cpu':>8}")
    models = ([lambda: load_model(None if args.model == "default" else args.model, quantization="auto")]
              if args.model else [lambda v=int(v): tiny_model(v, args.layers, args.hidden) for v in args.vocab.split(",")])
    for make_model in models:
        loaded = make_model()
        vocab = loaded.config.vocab_size
        config = EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * PROMPT_TOKENS,
                              max_model_len=512, num_decode_steps=args.num_decode_steps,
                              kv_cache_memory=None if args.model else 16 << 20)
        engine = Engine(loaded, config, progress=False)
        for batch in batches:
            for overlap in (True, False):
                engine.config = replace(config, async_scheduling=overlap)
                m = measure(engine, batch, args.decode_steps, args.constrained)
                print(f"{vocab:>7} {batch:>5} {'on' if overlap else 'off':>7} "
                      + " ".join(f"{m.phases[p]:>8.3f}" for p in PHASES)
                      + f" {m.host_ms:>8.3f} {m.wait_ms:>8.3f} {m.period_ms:>8.3f} {m.cpu_ms:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
