"""Decode paged-attention benchmark: time per call and achieved bandwidth, per backend.

    python -m sluice.bench.kernels                      # GPU: Llama-3-8B heads, batch {1,8,64,256} x context {512,2048,8192}
    python -m sluice.bench.kernels --markdown bench/RESULTS.md   # also append the table there

Backends: "pallas-triton" and "pallas-mosaic" (our kernels, `pallas_kernels/`), "reference" (the jnp/XLA
path), "jax-shipped" (`jax.experimental.pallas.ops.gpu.paged_attention`, an independent Pallas kernel,
deprecated from jax 0.11). On a CPU the defaults shrink to sizes that finish in seconds and run the
reference only, so the script cannot rot where no GPU exists (`--interpret --backends pallas-triton
reference jax-shipped` runs the interpretable backends there, slowly; the Mosaic kernels cannot be
interpreted).

Timing: one jitted program of `--calls` calls, unrolled as the model's layers are on a GPU, each call's
output fed into the next call's query (so XLA can neither hoist nor overlap them), timed with one
`block_until_ready`; the median over `--repeats` such programs, divided by the calls, after a compile-and-warm-up
run. Python's dispatch cost is thereby out of a microsecond-scale kernel's figure. A call's time includes what a
backend does around its kernel (the Mosaic and Triton wrappers pad the queries into tiles and slice the output);
`--trace` also runs the program once more under `jax.profiler` and reports the attention kernels' own device time
per call (`bench.device_profile`'s attention class), and the bandwidth at that time. Bandwidth counts the bytes
that must be read once: K and V of every context token plus q. Every row also reports the largest difference
from the reference output; a backend that fails on a shape gets a row with its error instead of stopping the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sluice.bench.device_profile import DeviceTrace
from sluice.pallas_kernels.attention import paged_decode_attention
from sluice.pallas_kernels.mosaic_attention import DEFAULT_TILING, Tiling, paged_decode_attention_mosaic, runs_on

SHIPPED_K_SPLITS = 16
SHIPPED_PAGES_PER_COMPUTE_BLOCK = 8
OUR_BACKENDS = ("pallas-triton", "pallas-mosaic", "reference")
ALL_BACKENDS = (*OUR_BACKENDS, "jax-shipped")


@dataclasses.dataclass(frozen=True)
class Heads:
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


@dataclasses.dataclass
class DecodeInputs:
    q: jax.Array  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array  # [num_pages, num_kv_heads, page_size, head_dim]
    v_pages: jax.Array
    kv_lens: jax.Array  # [batch] int32
    page_table: jax.Array  # [batch, pages_per_seq] int32

    def bytes_read(self) -> int:
        _, kv_heads, _, head_dim = self.k_pages.shape
        kv_tokens = int(np.asarray(self.kv_lens).sum())
        return 2 * kv_tokens * kv_heads * head_dim * self.k_pages.dtype.itemsize + self.q.nbytes


def make_inputs(heads: Heads, batch: int, context: int, page_size: int, dtype, seed: int = 0) -> DecodeInputs:
    """Every sequence at `context` tokens, its pages scattered over the pool."""
    key_q, key_k, key_v, key_p = jax.random.split(jax.random.key(seed), 4)
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    pool_shape = (num_pages, heads.num_kv_heads, page_size, heads.head_dim)
    return DecodeInputs(
        q=jax.random.normal(key_q, (batch, heads.num_q_heads, heads.head_dim), dtype),
        k_pages=jax.random.normal(key_k, pool_shape, dtype),
        v_pages=jax.random.normal(key_v, pool_shape, dtype),
        kv_lens=jnp.full((batch,), context, jnp.int32),
        page_table=jax.random.permutation(key_p, num_pages).reshape(batch, pages_per_seq).astype(jnp.int32),
    )


def shipped_paged_attention():
    """jax's own Pallas paged attention, or an ImportError saying why it is not there."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention
    except ImportError as exc:
        raise ImportError(f"jax {jax.__version__} does not ship jax.experimental.pallas.ops.gpu.paged_attention") from exc
    return paged_attention.paged_attention


def backend_call(name: str, inputs: DecodeInputs, sm_scale: float, interpret: bool = False,
                 tiling: Tiling = DEFAULT_TILING):
    """(fn, args): fn(q, *args) -> [batch, num_q_heads, head_dim], with layout changes done up front. `tiling`
    is the Mosaic kernel's."""
    if name in OUR_BACKENDS:
        if name == "pallas-mosaic" and tiling != DEFAULT_TILING:
            fn = functools.partial(paged_decode_attention_mosaic, sm_scale=sm_scale, tiling=tiling)
        else:
            fn = functools.partial(paged_decode_attention, sm_scale=sm_scale, backend=name, interpret=interpret)
        return fn, (inputs.k_pages, inputs.v_pages, inputs.kv_lens, inputs.page_table)
    if name == "jax-shipped":
        shipped = shipped_paged_attention()
        pages_per_seq = inputs.page_table.shape[1]
        k_splits = SHIPPED_K_SPLITS if pages_per_seq % SHIPPED_K_SPLITS == 0 else 1

        def fn(q, *rest):
            return shipped(q * sm_scale, *rest, k_splits=k_splits,
                           pages_per_compute_block=SHIPPED_PAGES_PER_COMPUTE_BLOCK, interpret=interpret)

        # Its pool layout is [num_kv_heads, num_pages, page_size, head_dim].
        return fn, (inputs.k_pages.transpose(1, 0, 2, 3), inputs.v_pages.transpose(1, 0, 2, 3),
                    inputs.page_table, inputs.kv_lens)
    raise ValueError(f"unknown backend {name!r}; choose from {ALL_BACKENDS}")


def chained(fn, calls: int):
    """A jitted program of `calls` calls of fn, each output added into the next query, unrolled as the model's
    layers run on a GPU (`model.llama.resolve_layer_loop`): a call costs what a layer's attention costs there,
    its wrapper's small ops beside the kernel included, and no loop's per-iteration control."""

    def loop(q, *args):
        for _ in range(calls):
            q = q + fn(q, *args).astype(q.dtype)
        return q

    return jax.jit(loop)


def time_backend(loop, q, args, calls: int, repeats: int) -> float:
    """Median seconds per call of `loop` (`chained`'s, of `calls` calls; see the module docstring)."""
    loop(q, *args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loop(q, *args).block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def traced_kernel_seconds(loop, q, args, calls: int) -> float | None:
    """Device seconds per call of the attention kernels alone, from a trace of one run of `loop` (compiled and
    warm: `time_backend`'s); None if the trace shows none (a CPU's reference has no such kernel)."""
    with DeviceTrace() as trace:
        loop(q, *args).block_until_ready()
    seconds = trace.summary().by_class["attention"] / calls
    return seconds or None


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300]


def run(args) -> list[dict]:
    heads = Heads(args.num_q_heads, args.num_kv_heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    sm_scale = heads.head_dim**-0.5
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            inputs = make_inputs(heads, batch, context, args.page_size, dtype)
            fn, rest = backend_call("reference", inputs, sm_scale)
            expected = np.asarray(jax.jit(fn)(inputs.q, *rest).astype(jnp.float32))
            for name, tiling in variants(args.backends, args.mosaic_tilings):
                row = dict(backend=name, batch=batch, context=context, bytes=inputs.bytes_read())
                name_shown = name
                if tiling != DEFAULT_TILING:
                    row["tiling"] = str(tiling)
                    name_shown = f"{name} {tiling}"
                try:
                    fn, rest = backend_call(name, inputs, sm_scale, args.interpret, tiling)
                    loop = chained(fn, args.calls)
                    seconds = time_backend(loop, inputs.q, rest, args.calls, args.repeats)
                    out = np.asarray(jax.jit(fn)(inputs.q, *rest).astype(jnp.float32))
                    row.update(ms=seconds * 1e3, gbps=inputs.bytes_read() / seconds / 1e9,
                               max_diff=float(np.abs(out - expected).max()))
                    if args.trace and (kernel_s := traced_kernel_seconds(loop, inputs.q, rest, args.calls)):
                        row.update(kernel_ms=kernel_s * 1e3, kernel_gbps=inputs.bytes_read() / kernel_s / 1e9)
                    print(f"  {name_shown:19s} batch {batch:4d} context {context:5d}: {seconds * 1e3:9.3f} ms",
                          file=sys.stderr)
                except Exception as exc:  # noqa: BLE001 - one backend failing must not hide the others' rows
                    row.update(error=first_line(exc))
                    print(f"  {name_shown:19s} batch {batch:4d} context {context:5d}: {row['error']}", file=sys.stderr)
                rows.append(row)
            del inputs
    return rows


def variants(backends: list[str], mosaic_tilings: list[Tiling]) -> list[tuple[str, Tiling]]:
    """(backend, tiling) pairs to time: the Mosaic kernel once per tiling, every other backend once."""
    return [(name, tiling) for name in backends
            for tiling in (mosaic_tilings if name == "pallas-mosaic" else [DEFAULT_TILING])]


def markdown(rows: list[dict], args, command: str) -> str:
    device = jax.devices()[0]
    lines = [
        f"### Decode paged attention, {datetime.date.today().isoformat()}, {device.device_kind} ({device.platform})",
        "",
        f"`{command}` - jax {jax.__version__}, {args.num_q_heads} q heads, {args.num_kv_heads} kv heads, "
        f"head_dim {args.head_dim}, {args.dtype}, page_size {args.page_size}, median of {args.repeats} runs "
        f"of {args.calls} chained calls, unrolled.",
        "",
        "| backend | batch | context | ms / call | GB/s (K+V+q once) | kernel ms (traced) | kernel GB/s "
        "| max abs diff vs reference |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        backend = f"{r['backend']} {r['tiling']}" if "tiling" in r else r["backend"]
        if "error" in r:
            lines.append(f"| {backend} | {r['batch']} | {r['context']} | failed: {r['error']} | | | | |")
            continue
        kernel = (f"{r['kernel_ms']:.4f} | {r['kernel_gbps']:.1f}" if "kernel_ms" in r else "- | -")
        lines.append(f"| {backend} | {r['batch']} | {r['context']} | {r['ms']:.4f} | {r['gbps']:.1f} | {kernel} | "
                     f"{r['max_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def default_backends() -> list[str]:
    """Every backend this device runs: all on a Hopper GPU, all but Mosaic on an older one, the reference on a CPU."""
    if jax.default_backend() != "gpu":
        return ["reference"]
    return [b for b in ALL_BACKENDS if b != "pallas-mosaic" or runs_on(jax.devices()[0])]


def parse_args(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(prog="python -m sluice.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256] if on_gpu else [1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192] if on_gpu else [128, 512])
    p.add_argument("--backends", nargs="+", default=default_backends(), choices=ALL_BACKENDS)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=10 if on_gpu else 2, help="chained calls per timed program")
    p.add_argument("--repeats", type=int, default=3 if on_gpu else 2, help="timed runs of the program (median)")
    p.add_argument("--mosaic-tilings", type=Tiling.parse, nargs="+", default=[DEFAULT_TILING],
                   help="the Mosaic kernel's tilings to time, each BLOCK_KVxSTAGES, n after it for a narrow query "
                        "tile (64x2, the default; 64x1, 64x2n, ...)")
    p.add_argument("--trace", action="store_true",
                   help="also the attention kernels' own device time per call, from a profiler trace of one run")
    p.add_argument("--interpret", action="store_true",
                   help="run the Triton and shipped kernels in interpret mode (checks the script on a CPU; "
                        "timings mean nothing)")
    p.add_argument("--markdown", help="append the table to this file")
    p.add_argument("--json", help="write the rows and the run's settings to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    command = "python -m sluice.bench.kernels " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = run(args)
    table = markdown(rows, args, command.strip())
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + table)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), rows=rows), indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
