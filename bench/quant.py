"""Quantized weights on this machine: matmul forms, then whole-model steps, per quantization mode.

    python -m bench.quant                         # both parts, default sizes
    python -m bench.quant --part forms --rows 1,8,64,512
    python -m bench.quant --part model --modes none,int8,int4

Part "forms": the model's 30-layer projection stack (q/k/v, o, gate/up, down, each layer fed by the last)
plus the LM head, SmolLM2's shapes with random weights, under one `lax.scan` as the model runs it, for each
candidate way to multiply: float32 XLA dot; int8 widened in front of XLA's dot; int8 weights with int8
activations (per-row scales) through XLA's int8 x int8 -> int32 dot; the int8 C++ kernel; int4 unpacked in
front of XLA's dot; the int4 C++ kernel. Times are medians over interleaved repeats (every form once per
round), so a change in the machine's load hits all forms alike.

Part "model": the real model (`load_model(quantization=...)`), jitted forward + logits on fixed shapes:
a decode step of B sequences at context C over the paged pool (reference attention), the same step with
attention replaced by the identity (what the rest of the step costs), and a prefill of P tokens. Modes with
":xla" run with the CPU kernels switched off (the XLA forms every bucket falls back to). All modes' steps are
compiled first and then timed in the same interleaved rounds.
"""

from __future__ import annotations

import argparse
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

from model.linear import Weight, dequantize
from model.quantize import quantize_int4, quantize_int8
from pallas_kernels import cpu_qmatmul

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

def _quant_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    return jnp.round(x / scale).astype(jnp.int8), scale


def _w8a8(x: jax.Array, w: Weight, layer) -> jax.Array:
    xq, sx = _quant_rows(x)
    values, scale = (w.values, w.scale) if layer is None else (w.values[layer], w.scale[layer])
    return lax.dot(xq, values, preferred_element_type=jnp.int32).astype(jnp.float32) * sx * scale


def _xla(x: jax.Array, w: Weight, layer) -> jax.Array:
    return jnp.dot(x, dequantize(w if layer is None else jax.tree.map(lambda a: a[layer], w), jnp.float32))


def _convert_then_scale(x: jax.Array, w: Weight, layer) -> jax.Array:
    """int8 converted in front of the dot, its scale applied to the output (XLA can fuse the convert)."""
    if layer is None:
        return jnp.dot(x, w.values.astype(jnp.float32)) * w.scale
    return jnp.dot(x, w.values[layer].astype(jnp.float32)) * w.scale[layer]


def _kernel(x: jax.Array, w: Weight, layer) -> jax.Array:
    if layer is None:  # the tied LM head, row-major [vocab, hidden]
        return cpu_qmatmul.q8_nk(x, w.values, w.scale)
    if w.format == "int8":
        return cpu_qmatmul.q8_kn(x, w.values, w.scale, layer)
    return cpu_qmatmul.q4_kn(x, w.values, w.scale, w.min, layer)


FORMS = {  # name -> (weight format, layer form, LM head form)
    "float32, XLA dot": ("float", _xla, _xla),
    "int8 widened (scaled before the dot), XLA dot": ("int8", _xla, _xla),
    "int8 converted, XLA dot, scale after": ("int8", _convert_then_scale, _convert_then_scale),
    "int8 x int8 -> int32, XLA dot": ("int8", _w8a8, _w8a8),
    "int8, C++ kernel": ("int8", _kernel, _kernel),
    "int4 unpacked, XLA dot": ("int4", _xla, _xla),
    "int4, C++ kernel": ("int4", _kernel, _kernel),
}


def _random_stack(seed: int = 0) -> dict[str, dict[str, Weight]]:
    rng = np.random.default_rng(seed)
    shapes = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}
    floats = {k: (rng.standard_normal((LAYERS, *s)) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
    table = (rng.standard_normal((VOCAB, HIDDEN)) * 0.05).astype(np.float32)
    head_int8 = Weight(*quantize_int8(table, 1))
    stacks = {
        "float": {k: Weight(jnp.asarray(v)) for k, v in floats.items()},
        "int8": {k: Weight(*quantize_int8(v, 1)) for k, v in floats.items()},
        "int4": {k: Weight(*quantize_int4(v, 1)) for k, v in floats.items()},
    }
    for fmt, stack in stacks.items():
        stack["head"] = Weight(jnp.asarray(table)) if fmt == "float" else head_int8
    # The LM head of the XLA forms multiplies [hidden, vocab]; the kernel reads the table row-major.
    for fmt in ("float", "int8", "int4"):
        stacks[fmt]["head_kn"] = jax.tree.map(lambda a: a.T, stacks[fmt]["head"])
    return stacks


def _stack_fn(fmt: str, layer_form, head_form, stacks) -> Callable[[jax.Array], jax.Array]:
    w = stacks[fmt]
    head = w["head"] if head_form is _kernel else w["head_kn"]

    def run(x: jax.Array) -> jax.Array:
        def layer(h, index):
            qkv = layer_form(h, w["qkv"], index)
            h = h + 1e-3 * layer_form(qkv[:, :HIDDEN], w["o"], index)
            gate_up = layer_form(h, w["gate_up"], index)
            return h + 1e-3 * layer_form(gate_up[:, :FFN], w["down"], index), None

        h, _ = lax.scan(layer, x, jnp.arange(LAYERS, dtype=jnp.int32))
        return head_form(h, head, None)

    return jax.jit(run)


def bench_forms(rows: list[int], repeats: int) -> list[tuple[int, str, float]]:
    stacks = _random_stack()
    forms = {n: f for n, f in FORMS.items() if "kernel" not in n or cpu_qmatmul.available()}
    out = []
    for m in rows:
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, HIDDEN)), jnp.float32)
        fns = {name: (lambda fn=_stack_fn(*spec, stacks): fn(x)) for name, spec in forms.items()}
        reps = repeats if m <= 64 else max(3, repeats // 3)
        for name, seconds in _interleaved_medians(fns, reps).items():
            out.append((m, name, seconds))
            print(f"  forms M={m:4d} {name:32s} {seconds * 1e3:9.2f} ms", file=sys.stderr, flush=True)
    return out


# ---- Part 2: the whole model.

def _model_fns(mode: str, batch_sizes: list[int], context: int, prefill: int) -> dict[str, Callable[[], object]]:
    from model.llama import empty_kv_cache
    from model.loader import load_model
    from model.paged_attend import AttentionMetadata, flat_pool, make_paged_attend

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

        @jax.jit
        def step(state, kv):
            model = nnx.merge(graphdef, state)
            if attention:
                attend = make_paged_attend(meta, num_pages, sm_scale=config.head_dim**-0.5, backend="reference")
            else:
                attend = lambda layer, q, k, v, cache: (q, cache)
            hidden, kv = model(tokens, positions, flat_pool(kv), attend)
            return model.logits(hidden[last_rows])

        return lambda: step(state, kv)

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
        original = cpu_qmatmul.available
        if form == "xla":
            cpu_qmatmul.available = lambda: False
        try:
            for name, fn in _model_fns(mode, batch_sizes, context, prefill).items():
                jax.block_until_ready(fn())  # compiles while the form is chosen
                fns[spec, name] = fn
        finally:
            cpu_qmatmul.available = original
    out = []
    for (spec, name), seconds in _interleaved_medians(fns, repeats).items():
        out.append((spec, name, seconds))
        print(f"  model {spec:10s} {name:28s} {seconds * 1e3:9.2f} ms", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("forms", "model", "all"), default="all")
    parser.add_argument("--rows", default="1,8,64,512", help="M values for the forms part")
    parser.add_argument("--modes", default="none,int8,int4,int8:xla,int4:xla")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    command = "python -m bench.quant " + shlex.join(argv if argv is not None else sys.argv[1:])
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
