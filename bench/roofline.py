"""The physical limit a throughput figure is measured against, from peaks measured on this machine.

Peaks: memory bandwidth from large jitted read-only passes (a sum, a matrix-vector product) and float32
matmul rate from large jitted matmuls; best of a few runs, after a compile-and-warm run.

Bound for a workload at decode batch B: prefill is compute-bound (2 FLOPs per matmul weight per prompt
token plus causal attention); every decode step reads all weights once plus the batch's KV cache, and
does 2 FLOPs per weight per token plus attention over the context, taking max(bytes / bandwidth,
FLOPs / matmul rate). Decode needs (output tokens / B) steps at the workload's mean decode context.
Output tokens over (prefill time + decode time) is the bound; achieved / bound is the fraction reported.

`python -m bench.roofline --save peaks.json` measures and saves the peaks, so a benchmark that shares
its machine with the server (a GPU) can measure before the server starts and pass the file along.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from model.config import ModelConfig

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


def measure_peaks(elements: int = 1 << 26, matmul_sizes: Sequence[int] = (1024, 2048), repeats: int = 5) -> Peaks:
    """Measures the default JAX device.

    Bandwidth: bytes read per second, the best of a sum over `elements` float32 values and a matrix-vector
    product over a matrix as large (a decode step's access pattern: every weight read once). Neither writes
    a large output, so fresh-page faults are not timed. Matmul rate: the best over n x n x n float32 matmuls.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((elements,), jnp.float32)
    total = jax.jit(jnp.sum)
    sum_s = _best_seconds(lambda: total(x).block_until_ready(), repeats)
    side = math.isqrt(elements)
    matrix, vector = jnp.ones((side, side), jnp.float32), jnp.ones((side,), jnp.float32)
    gemv = jax.jit(lambda m, v: m @ v)
    gemv_s = _best_seconds(lambda: gemv(matrix, vector).block_until_ready(), repeats)
    bandwidth = max(4 * elements / sum_s, 4 * side * side / gemv_s)
    del x, matrix
    matmul = jax.jit(lambda p, q: p @ q)
    flops = 0.0
    for n in matmul_sizes:
        a = jnp.ones((n, n), jnp.float32)
        flops = max(flops, 2 * n**3 / _best_seconds(lambda: matmul(a, a).block_until_ready(), repeats))
    return Peaks(bandwidth / 1e9, flops / 1e9, str(jax.devices()[0].device_kind))


def matmul_weights(config: ModelConfig) -> int:
    """Weights every token multiplies by: attention and MLP projections of all layers, and the LM head."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q_out + 2 * kv_out) + q_out * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype_bytes


def attention_flops(config: ModelConfig, context: float) -> float:
    """One query token attending to `context` keys: QK^T and PV, 2 FLOPs per multiply-add each."""
    return config.num_layers * 4 * config.num_heads * config.head_dim * context


@dataclass(frozen=True)
class Roofline:
    batch: float
    mean_decode_context: float
    step_bytes: float
    step_flops: float
    step_memory_s: float
    step_compute_s: float
    prefill_s: float
    decode_s: float
    bound_output_tps: float

    @property
    def step_limited_by(self) -> str:
        return "memory" if self.step_memory_s >= self.step_compute_s else "compute"

    def line(self, achieved_output_tps: float) -> str:
        return (
            f"roofline: batch {self.batch:.1f}, decode context {self.mean_decode_context:.0f}: step "
            f"{self.step_bytes / 1e6:.0f} MB -> {self.step_memory_s * 1e3:.1f} ms, "
            f"{self.step_flops / 1e9:.1f} GFLOP -> {self.step_compute_s * 1e3:.1f} ms ({self.step_limited_by}-bound); "
            f"limit {self.bound_output_tps:.0f} output tok/s, achieved {achieved_output_tps:.0f} = "
            f"{achieved_output_tps / self.bound_output_tps:.1%} of the physical limit"
        )


def workload_roofline(
    config: ModelConfig,
    dtype: str,
    peaks: Peaks,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    batch: float,
) -> Roofline:
    dtype_bytes = BYTES[dtype]
    weights = matmul_weights(config)
    batch = max(batch, 1.0)
    bandwidth, rate = peaks.bandwidth_gbs * 1e9, peaks.matmul_gflops * 1e9

    prompt_tokens = sum(prompt_lens)
    prefill_flops = 2 * weights * prompt_tokens + sum(attention_flops(config, p / 2) * p for p in prompt_lens)
    output_tokens = sum(output_lens)
    # Generated token i of a request attends to prompt + i keys; average over all generated tokens.
    context = sum(p * o + o * (o - 1) / 2 for p, o in zip(prompt_lens, output_lens)) / output_tokens

    step_bytes = weights * dtype_bytes + batch * context * kv_bytes_per_token(config, dtype_bytes)
    step_flops = batch * (2 * weights + attention_flops(config, context))
    step_memory_s, step_compute_s = step_bytes / bandwidth, step_flops / rate
    prefill_s = prefill_flops / rate
    decode_s = output_tokens / batch * max(step_memory_s, step_compute_s)
    return Roofline(
        batch=batch,
        mean_decode_context=context,
        step_bytes=step_bytes,
        step_flops=step_flops,
        step_memory_s=step_memory_s,
        step_compute_s=step_compute_s,
        prefill_s=prefill_s,
        decode_s=decode_s,
        bound_output_tps=output_tokens / (prefill_s + decode_s),
    )


def read_model_config(model: str | None) -> ModelConfig:
    """The shape of `model` (a .gguf, an HF folder or None for the default), read from its metadata only."""
    from model.fetch import resolve_model

    source = resolve_model(model)
    if source.is_dir():
        return ModelConfig.from_hf(json.loads((source / "config.json").read_text()))
    import gguf

    reader = gguf.GGUFReader(str(source))
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return ModelConfig.from_gguf_fields(fields, tied_embeddings=all(t.name != "output.weight" for t in reader.tensors))


def peaks_from(path: Path | None) -> Peaks:
    return Peaks.load(path) if path is not None else measure_peaks()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", type=Path, default=None, help="write the measured peaks to this JSON file")
    args = parser.parse_args()
    peaks = measure_peaks()
    print(f"{peaks.device}: memory bandwidth {peaks.bandwidth_gbs:.1f} GB/s, float32 matmul {peaks.matmul_gflops:.0f} GFLOP/s")
    if args.save is not None:
        peaks.save(args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
