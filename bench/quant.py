"""Quantized weights on this machine: matmul forms, then whole-model steps, per quantization mode.

    python -m sluice.bench.quant                         # both parts, default sizes
    python -m sluice.bench.quant --part forms --rows 1,8,64,512
    python -m sluice.bench.quant --part model --modes none,int8,int4

Part "forms": the model's 30-layer projection stack (q/k/v, o, gate/up, down, each layer fed by the last)
plus the LM head, SmolLM2's shapes with random weights, under one `lax.scan` as the model runs it, through the
model's own `model.linear.project` for each weight format: float32 (XLA's dot); Q8_0 and Q4_1 through the C++
kernels (activations quantized per block of 32, integer dot products); Q8_0 and Q4_1 dequantized in front of
XLA's dot (the weight-only form every mode falls back to without the kernels). Times are medians over
interleaved repeats (every form once per round), so a change in the machine's load hits all forms alike.

Part "model": the real model (`load_model(quantization=...)`), jitted forward + logits on fixed shapes:
a decode step of B sequences at context C over the paged pool (the CPU attention kernel), the same step with
attention replaced by the identity (what the rest of the step costs), and a prefill of P tokens. Modes with
":xla" run with the CPU matmul kernels switched off. All modes' steps are compiled first and then timed in the
same interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from sluice.model.linear import Weight, project
from sluice.model.quantize import quantize_params
from sluice.pallas_kernels import cpu_qmatmul

LAYERS, HIDDEN, FFN, VOCAB, QKV = 30, 576, 1536, 49152, 960


def _interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call; each round calls every function once (after one warm-up call each)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# ---- Part 1: matmul forms.

FORMS = {  # name -> (quantization of the weights, whether the CPU kernels may run)
    "float32, XLA dot": ("none", False),
    "Q8_0, C++ kernel": ("int8", True),
    "Q4_1 (Q8_0 LM head), C++ kernel": ("int4", True),
    "Q8_0 dequantized, XLA dot": ("int8", False),
    "Q4_1 dequantized, XLA dot": ("int4", False),
}


def _random_stacks(seed: int = 0) -> dict[str, dict[str, Weight]]:
    """Per quantization: the stacked layer weights (by the model's parameter names) and the LM head."""
    rng = np.random.default_rng(seed)
    shapes = {"wqkv": (HIDDEN, QKV), "wo": (HIDDEN, HIDDEN), "w_gate_up": (HIDDEN, 2 * FFN), "w_down": (FFN, HIDDEN)}
    floats = {k: jnp.asarray(rng.standard_normal((LAYERS, *s)) / np.sqrt(s[0]), jnp.float32) for k, s in shapes.items()}
    floats["lm_head"] = jnp.asarray(rng.standard_normal((HIDDEN, VOCAB)) * 0.05, jnp.float32)
    stacks = {}
    for quantization in ("none", "int8", "int4"):
        params = quantize_params(floats, quantization)
        part = lambda name, suffix: params.get(name + suffix)
        stacks[quantization] = {name: Weight(params[name], part(name, "_scale"), part(name, "_min")) for name in floats}
    return stacks


def _stack_fn(w: dict[str, Weight]) -> Callable[[jax.Array], jax.Array]:
    def run(x: jax.Array) -> jax.Array:
        def layer(h, index):
            qkv = project(h, w["wqkv"], index)
            h = h + 1e-3 * project(qkv[:, :HIDDEN], w["wo"], index)
            gate_up = project(h, w["w_gate_up"], index)
            return h + 1e-3 * project(gate_up[:, :FFN], w["w_down"], index), None

        h, _ = lax.scan(layer, x, jnp.arange(LAYERS, dtype=jnp.int32))
        return project(h, w["lm_head"])

    return jax.jit(run)


def bench_forms(rows: list[int], repeats: int) -> list[tuple[int, str, float]]:
    stacks = _random_stacks()
    forms = {n: f for n, f in FORMS.items() if not f[1] or cpu_qmatmul.available()}
    out = []
    for m in rows:
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, HIDDEN)), jnp.float32)
        fns = {}
        for name, (quantization, kernels) in forms.items():
            with _kernels(kernels):
                fn = _stack_fn(stacks[quantization])
                jax.block_until_ready(fn(x))  # compiles while the form is chosen
            fns[name] = lambda fn=fn: fn(x)
        reps = repeats if m <= 64 else max(3, repeats // 3)
        for name, seconds in _interleaved_medians(fns, reps).items():
            out.append((m, name, seconds))
            print(f"  forms M={m:4d} {name:34s} {seconds * 1e3:9.2f} ms", file=sys.stderr, flush=True)
    return out


@contextlib.contextmanager
def _kernels(enabled: bool):
    """Switches the CPU matmul kernels off while tracing (the form is chosen then)."""
    original = cpu_qmatmul.available
    if not enabled:
        cpu_qmatmul.available = lambda: False
    try:
        yield
    finally:
        cpu_qmatmul.available = original


# ---- Part 2: the whole model.

def _model_fns(mode: str, batch_sizes: list[int], context: int, prefill: int) -> dict[str, Callable[[], object]]:
    from sluice.model.llama import empty_kv_cache
    from sluice.model.loader import load_model
    from sluice.model.paged_attend import AttentionMetadata, flat_pool, layered_pool, make_paged_attend

    loaded = load_model(dtype="float32", quantization=mode)
    config = loaded.config
    graphdef, state = nnx.split(loaded.model)
    page_size = 16
    fns = {}

    def step_fn(num_tokens: int, num_seqs: int, kv_len: int, attention: bool):
        pages_per_seq = -(-kv_len // page_size)
        num_pages = num_seqs * pages_per_seq
        kv = empty_kv_cache(config, num_pages, page_size, jnp.float32)
        q_len = num_tokens // num_seqs
        meta = AttentionMetadata(
            slot_mapping=jnp.asarray(
                [s * pages_per_seq * page_size + kv_len - q_len + i for s in range(num_seqs) for i in range(q_len)],
                jnp.int32),
            kv_lens=jnp.full((num_seqs,), kv_len, jnp.int32),
            page_table=jnp.arange(num_pages, dtype=jnp.int32).reshape(num_seqs, pages_per_seq),
            cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len,
            max_q_len=q_len,
        )
        tokens = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, num_tokens), jnp.int32)
        positions = jnp.tile(jnp.arange(kv_len - q_len, kv_len, dtype=jnp.int32), num_seqs)
        last_rows = jnp.arange(1, num_seqs + 1, dtype=jnp.int32) * q_len - 1

        # The pool is donated and rebound each call, as the engine runs its steps: without it, every call would
        # also copy the whole pool to write the step's K/V, and that copy would count as attention.
        @functools.partial(jax.jit, donate_argnums=1)
        def step(state, kv):
            model = nnx.merge(graphdef, state)
            if attention:
                attend = make_paged_attend(meta, num_pages, sm_scale=config.softmax_scale, backend="auto")
            else:
                attend = lambda layer, q, k, v, cache: (q, cache)
            hidden, kv = model(tokens, positions, flat_pool(kv), attend)
            return model.logits(hidden[last_rows]), layered_pool(kv, config.num_layers)

        pool = [kv]

        def run() -> jax.Array:
            logits, pool[0] = step(state, pool[0])
            return logits

        return run

    for b in batch_sizes:
        fns[f"decode B={b} C={context}"] = step_fn(b, b, context, True)
        fns[f"decode B={b}, no attention"] = step_fn(b, b, context, False)
    fns[f"prefill {prefill} tokens"] = step_fn(prefill, 1, prefill, True)
    return fns


def bench_model(modes: list[str], batch_sizes: list[int], context: int, prefill: int, repeats: int):
    """Every mode's steps compiled first, then all timed in the same interleaved rounds."""
    fns = {}
    for spec in modes:
        mode, _, form = spec.partition(":")
        with _kernels(form != "xla"):
            for name, fn in _model_fns(mode, batch_sizes, context, prefill).items():
                jax.block_until_ready(fn())  # compiles while the form is chosen
                fns[spec, name] = fn
    out = []
    for (spec, name), seconds in _interleaved_medians(fns, repeats).items():
        out.append((spec, name, seconds))
        print(f"  model {spec:10s} {name:28s} {seconds * 1e3:9.2f} ms", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.quant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("forms", "model", "all"), default="all")
    parser.add_argument("--rows", default="1,8,64,512", help="M values for the forms part")
    parser.add_argument("--modes", default="none,int8,int4")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    command = "python -m sluice.bench.quant " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"{command}\n(jax {jax.__version__}, {jax.devices()[0].device_kind}, CPU kernels "
          f"{'built' if cpu_qmatmul.available() else 'not built'})\n")
    if args.part in ("forms", "all"):
        rows = [int(r) for r in args.rows.split(",")]
        results = bench_forms(rows, args.repeats)
        names = list(dict.fromkeys(name for _, name, _ in results))
        table = {(m, name): s for m, name, s in results}
        print("| form (30 layers + LM head) | " + " | ".join(f"M={m}" for m in rows) + " |")
        print("|---|" + "---:|" * len(rows))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{table[m, name] * 1e3:.1f} ms" for m in rows) + " |")
        print()
    if args.part in ("model", "all"):
        modes = args.modes.split(",")
        batches = [int(b) for b in args.batch_sizes.split(",")]
        results = bench_model(modes, batches, args.context, args.prefill, args.repeats)
        names = list(dict.fromkeys(name for _, name, _ in results))
        table = {(mode, name): s for mode, name, s in results}
        print("| forward + logits | " + " | ".join(modes) + " |")
        print("|---|" + "---:|" * len(modes))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{table[m, name] * 1e3:.1f} ms" for m in modes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
