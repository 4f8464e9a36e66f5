"""Decode paged-attention benchmark: time per call and achieved bandwidth, per backend.

    python bench/kernels.py                      # GPU: Llama-3-8B heads, batch {1,8,64,256} x context {512,2048,8192}
    python bench/kernels.py --markdown bench/RESULTS.md   # also append the table there

Backends: "pallas" (our decode kernel), "reference" (the jnp/XLA path), "jax-shipped"
(`jax.experimental.pallas.ops.gpu.paged_attention`, an independent Pallas kernel). On a CPU the
defaults shrink to sizes that finish in seconds and run the reference only, so the script cannot
rot where no GPU exists (`--interpret --backends pallas reference jax-shipped` runs every backend
there, slowly). Bandwidth counts the bytes that must be read once: K and V of every
context token plus q. Every row also reports the largest difference from the reference output.
"""

import argparse
import dataclasses
import datetime
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as shipped

from pallas_kernels.attention import paged_decode_attention

SHIPPED_K_SPLITS = 16
SHIPPED_PAGES_PER_COMPUTE_BLOCK = 8


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


def backend_fn(name: str, inputs: DecodeInputs, sm_scale: float, interpret: bool = False):
    """A zero-argument jitted call of one backend on these inputs (layout changes done up front)."""
    if name in ("pallas", "reference"):
        fn = jax.jit(functools.partial(
            paged_decode_attention, sm_scale=sm_scale, backend=name, interpret=interpret and name == "pallas"
        ))
        args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.kv_lens, inputs.page_table)
    elif name == "jax-shipped":
        pages_per_seq = inputs.page_table.shape[1]
        k_splits = SHIPPED_K_SPLITS if pages_per_seq % SHIPPED_K_SPLITS == 0 else 1
        fn = jax.jit(
            lambda q, *rest: shipped.paged_attention(
                q * sm_scale, *rest, k_splits=k_splits,
                pages_per_compute_block=SHIPPED_PAGES_PER_COMPUTE_BLOCK, interpret=interpret,
            )
        )
        # Its pool layout is [num_kv_heads, num_pages, page_size, head_dim].
        args = (
            inputs.q, inputs.k_pages.transpose(1, 0, 2, 3), inputs.v_pages.transpose(1, 0, 2, 3),
            inputs.page_table, inputs.kv_lens,
        )
    else:
        raise ValueError(f"unknown backend {name!r}")
    return lambda: fn(*args)


def time_call(call, iters: int) -> float:
    """Median seconds per call after a compile-and-warm-up call."""
    call().block_until_ready()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call().block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args) -> list[dict]:
    heads = Heads(args.num_q_heads, args.num_kv_heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    sm_scale = heads.head_dim**-0.5
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            inputs = make_inputs(heads, batch, context, args.page_size, dtype)
            expected = np.asarray(backend_fn("reference", inputs, sm_scale)().astype(jnp.float32))
            for name in args.backends:
                call = backend_fn(name, inputs, sm_scale, args.interpret)
                seconds = time_call(call, args.iters)
                diff = np.abs(np.asarray(call().astype(jnp.float32)) - expected).max()
                rows.append(dict(
                    backend=name, batch=batch, context=context, ms=seconds * 1e3,
                    gbps=inputs.bytes_read() / seconds / 1e9, max_diff=float(diff),
                ))
                print(f"  {name:12s} batch {batch:4d} context {context:5d}: {seconds * 1e3:9.3f} ms", file=sys.stderr)
            del inputs
    return rows


def markdown(rows: list[dict], args, command: str) -> str:
    device = jax.devices()[0]
    lines = [
        f"### Decode paged attention, {datetime.date.today().isoformat()}, {device.device_kind} ({device.platform})",
        "",
        f"`{command}` - jax {jax.__version__}, {args.num_q_heads} q heads, {args.num_kv_heads} kv heads, "
        f"head_dim {args.head_dim}, {args.dtype}, page_size {args.page_size}, median of {args.iters} calls.",
        "",
        "| backend | batch | context | ms / call | GB/s (K+V+q once) | max abs diff vs reference |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['context']} | {r['ms']:.3f} | {r['gbps']:.1f} | {r['max_diff']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256] if on_gpu else [1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192] if on_gpu else [128, 512])
    p.add_argument("--backends", nargs="+", default=["pallas", "reference", "jax-shipped"] if on_gpu else ["reference"],
                   choices=["pallas", "reference", "jax-shipped"])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20 if on_gpu else 3)
    p.add_argument("--interpret", action="store_true",
                   help="run the Pallas backends in interpret mode (checks the script on a CPU; timings mean nothing)")
    p.add_argument("--markdown", help="append the table to this file")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    command = "python bench/kernels.py " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(run(args), args, command.strip())
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
