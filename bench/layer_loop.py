"""Which form of a per-layer weight lets XLA multiply it in place, without copying the layer out first.

    [XLA_FLAGS=...] python -m sluice.bench.layer_loop

Eight layers of a Llama-3-8B MLP-sized bf16 weight (a tenth of that on a CPU), multiplied by 1 and 64 rows:
under a scan (the stack closed over and indexed by the layer, or passed as the scan's xs, or stored
transposed), unrolled with a static index into the stack, and unrolled over one array per layer. Prints the
median time of each and a count of the slice copies in its compiled HLO. Figures: bench/RESULTS.md.
"""

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

L, K, N = (8, 4096, 14336) if jax.default_backend() != "cpu" else (2, 256, 512)


def timed(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copies(fn, *args) -> int:
    text = fn.lower(*args).compile().as_text()
    return sum(1 for line in text.splitlines()
               if "= bf16[" in line and any(s in line for s in ("dynamic_slice", "slice_fusion", " copy(")))


def main() -> None:
    key = jax.random.key(0)
    stack = jax.random.normal(key, (L, K, N), jnp.bfloat16)
    stack_t = jnp.swapaxes(stack, 1, 2).copy()  # [L, N, K]
    single = [stack[i] + 0 for i in range(L)]
    for rows in (1, 64):
        x = jax.random.normal(key, (rows, K), jnp.bfloat16)

        def scan_closed(x, w):
            def body(h, i):
                return h, jnp.dot(h, w[i], preferred_element_type=jnp.float32)[:, :K].astype(h.dtype)
            return lax.scan(body, x, jnp.arange(L))[1]

        def scan_xs(x, w):
            def body(h, wi):
                return h, jnp.dot(h, wi, preferred_element_type=jnp.float32)[:, :K].astype(h.dtype)
            return lax.scan(body, x, w)[1]

        def scan_closed_t(x, w):
            def body(h, i):
                y = lax.dot_general(h, w[i], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                return h, y[:, :K].astype(h.dtype)
            return lax.scan(body, x, jnp.arange(L))[1]

        def unrolled_static(x, w):
            return [jnp.dot(x, w[i], preferred_element_type=jnp.float32)[:, :K] for i in range(L)]

        def separate(x, ws):
            return [jnp.dot(x, wi, preferred_element_type=jnp.float32)[:, :K] for wi in ws]

        def separate_t(x, ws):
            return [lax.dot_general(x, wi, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)[:, :K]
                    for wi in ws]

        single_t = [stack_t[i] + 0 for i in range(L)]
        variants = [("scan, closed-over [L,K,N]", scan_closed, stack), ("scan, xs [L,K,N]", scan_xs, stack),
                    ("scan, closed-over [L,N,K]", scan_closed_t, stack_t),
                    ("unrolled, static index [L,K,N]", unrolled_static, stack),
                    ("unrolled, separate [K,N]", separate, single), ("unrolled, separate [N,K]", separate_t, single_t)]
        floor_ms = L * K * N * 2 / 3.8e12 * 1e3
        for name, fn, w in variants:
            fn = jax.jit(fn)
            seconds = timed(fn, x, w)
            print(f"RESULT rows={rows} {name}: {seconds * 1e3:.3f} ms ({floor_ms / (seconds * 1e3):.0%} of a 3.8 TB/s "
                  f"floor) copies={copies(fn, x, w)}", flush=True)


if __name__ == "__main__":
    main()
