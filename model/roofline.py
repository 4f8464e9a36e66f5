"""What a step costs and what the device can do: the two sides of a roofline.

Costs, from the model's shape: every computed token multiplies by every matmul weight (2 FLOPs each), attention
does 4 FLOPs per head dimension for each query-key pair, and a forward pass reads every weight once (an untied
embedding table only by rows, so not counted) plus the cached K/V it attends to.

Peaks, measured on the device: memory bandwidth from large jitted read-only passes (a sum, a matrix-vector
product), matmul rate from large jitted matmuls; best of a few runs, after a compile-and-warm run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from sluice.model.config import ModelConfig
from sluice.pallas_kernels import cpu_qmatmul
from sluice.pallas_kernels.kv_cache import row_bytes


def matmul_weights(config: ModelConfig) -> int:
    """Weights every token multiplies by: attention and MLP projections of all layers, and the LM head."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q_out + 2 * kv_out) + q_out * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def kv_bytes_per_token(config: ModelConfig, kv_dtype) -> int:
    """K and V of one token over all layers and KV heads, in a pool of `kv_dtype` (int8: with its scales)."""
    return config.num_layers * 2 * config.num_kv_heads * row_bytes(config.head_dim, kv_dtype)


def attention_flops(config: ModelConfig, context: float) -> float:
    """One query token attending to `context` keys: QK^T and PV, 2 FLOPs per multiply-add each."""
    return config.num_layers * 4 * config.num_heads * config.head_dim * context


def _nbytes(tree: object) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def param_bytes(model: nnx.Module) -> int:
    return _nbytes(nnx.state(model))


@dataclass(frozen=True)
class StepCost:
    """A loaded model's cost coefficients: FLOPs per computed token and per attended query-key pair, bytes
    of weights one forward pass reads, bytes of K/V per cached token."""

    flops_per_token: float
    flops_per_attended_key: float
    weight_bytes: float
    kv_bytes_per_token: float

    @classmethod
    def of(cls, config: ModelConfig, model: nnx.Module, kv_dtype) -> StepCost:
        """Weight bytes as stored (quantized weights count their scales)."""
        flat = nnx.to_flat_state(nnx.state(model))
        read = [var for path, var in flat if config.tie_word_embeddings or not str(path[0]).startswith("embed")]
        return cls(2.0 * matmul_weights(config), attention_flops(config, 1), _nbytes(read),
                   kv_bytes_per_token(config, kv_dtype))

    def flops(self, tokens: int, attended_keys: int) -> float:
        return self.flops_per_token * tokens + self.flops_per_attended_key * attended_keys

    def bytes(self, forward_passes: int, kv_tokens_read: int) -> float:
        return self.weight_bytes * forward_passes + self.kv_bytes_per_token * kv_tokens_read


@dataclass(frozen=True)
class Peaks:
    bandwidth_gbs: float
    matmul_gflops: float
    device: str

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Peaks:
        return cls(**json.loads(path.read_text()))


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # compile and warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def stream_loops(passes: int) -> tuple[Callable, Callable]:
    """Two jitted loops of `passes` passes over a [rows, cols] array, each pass depending on the last so that XLA
    can neither hoist nor merge them, even unrolled: row sums (reads the array: [rows] out) and adding one (reads
    and writes it, STREAM's copy measure: the array out; XLA does not reassociate float adds, where it would fold
    a sign flip's pairs)."""

    def read(m):  # max(m - c, 0): no algebra takes the sum out of the loop
        return lax.fori_loop(0, passes, lambda _, acc: acc + jnp.maximum(m - acc[:1, None], 0).sum(axis=1),
                             jnp.zeros(m.shape[0], m.dtype))

    def read_write(m):
        return lax.fori_loop(0, passes, lambda _, a: a + 1, m)

    return jax.jit(read), jax.jit(read_write)


def streamed_bandwidth(m: jax.Array, repeats: int, passes: int = 10) -> float:
    """Bytes per second of one pass over m, the better of `stream_loops`' two. Each is timed as a loop of 2 x passes
    less one of `passes`, so that what a call costs once (dispatch, the wait for its result, the loop's first copy
    of m) cancels."""
    short, long = stream_loops(passes), stream_loops(2 * passes)
    best = 0.0
    for bytes_per_pass, short_loop, long_loop in zip((m.nbytes, 2 * m.nbytes), short, long):
        extra_s = (_best_seconds(lambda: long_loop(m).block_until_ready(), repeats)
                   - _best_seconds(lambda: short_loop(m).block_until_ready(), repeats))
        if extra_s > 0:
            best = max(best, bytes_per_pass * passes / extra_s)
    return best


def int8_kernel_seconds(n: int, repeats: int) -> float:
    """The best time of the CPU's Q8_0 kernel over an n x n x n product (x [n, n] f32 by an [n, n] int8 weight,
    activations quantized to int8 inside the kernel)."""
    x = jnp.ones((n, n), jnp.float32)
    w = jnp.ones((1, n // cpu_qmatmul.PANEL, n // 4, cpu_qmatmul.PANEL, 4), jnp.int8)
    scale = jnp.ones((1, n // cpu_qmatmul.PANEL, n // cpu_qmatmul.BLOCK, cpu_qmatmul.PANEL), jnp.float16)
    product = jax.jit(lambda x, w, scale: cpu_qmatmul.q8_q8(x, w, scale, 0))
    return _best_seconds(lambda: product(x, w, scale).block_until_ready(), repeats)


def measure_peaks(elements: int = 1 << 26, matmul_sizes: Sequence[int] = (1024, 2048), repeats: int = 5,
                  dtype: str = "float32") -> Peaks:
    """Measures the default JAX device.

    Bandwidth: bytes read per second, the best of a sum over `elements` float32 values, the same values summed
    per row of 8192 (on a GPU XLA reads rows faster than one long reduction) and a matrix-vector product over a
    matrix as large (a decode step's access pattern: every weight read once), each timed one call at a time. None
    writes a large output, so fresh-page faults are not timed. On a GPU also `streamed_bandwidth`: passes timed
    inside a loop, as the kernel benchmark times its kernels, reading and reading-and-writing. Timed one call at a
    time, an H200 read 3.6-3.9 TB/s, and its decode attention kernel, timed in a loop, read 4.1: over 100% of
    that peak. A streamed figure over 1.5 x the others would mean XLA took passes out of the loop, and is not taken.
    Matmul rate: the best over n x n x n matmuls in `dtype` ("int8": int8 x int8 -> int32, the arithmetic of the
    CPU's quantized-weight kernels; 2 ops per multiply-add as for floats). For int8 on a CPU, also Sluice's own Q8_0
    kernel (`int8_kernel_seconds`): XLA's int8 dot has no fast path without VNNI, and on a 2-core AVX2 EPYC it ran
    at the float32 rate, below what the serving kernels reach.
    """
    x = jnp.ones((elements,), jnp.float32)
    total = jax.jit(jnp.sum)
    sum_s = _best_seconds(lambda: total(x).block_until_ready(), repeats)
    rows = x.reshape(-1, 8192) if elements % 8192 == 0 else x[None]
    row_sums = jax.jit(lambda a: a.sum(axis=1))
    row_sum_s = _best_seconds(lambda: row_sums(rows).block_until_ready(), repeats)
    side = math.isqrt(elements)
    matrix, vector = jnp.ones((side, side), jnp.float32), jnp.ones((side,), jnp.float32)
    gemv = jax.jit(lambda m, v: m @ v)
    gemv_s = _best_seconds(lambda: gemv(matrix, vector).block_until_ready(), repeats)
    bandwidth = max(4 * elements / sum_s, 4 * elements / row_sum_s, 4 * side * side / gemv_s)
    if jax.default_backend() == "gpu" and (streamed := streamed_bandwidth(rows, repeats)) < 1.5 * bandwidth:
        bandwidth = max(bandwidth, streamed)
    del x, rows, matrix
    accumulate = jnp.int32 if dtype == "int8" else None
    matmul = jax.jit(lambda p, q: jnp.matmul(p, q, preferred_element_type=accumulate))
    flops = 0.0
    for n in matmul_sizes:
        a = jnp.ones((n, n), dtype)
        flops = max(flops, 2 * n**3 / _best_seconds(lambda: matmul(a, a).block_until_ready(), repeats))
        if dtype == "int8" and cpu_qmatmul.available():
            flops = max(flops, 2 * n**3 / int8_kernel_seconds(n, repeats))
    return Peaks(bandwidth / 1e9, flops / 1e9, str(jax.devices()[0].device_kind))
