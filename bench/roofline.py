"""The physical limit a throughput figure is measured against, from peaks measured on this machine.

Peaks and per-token costs come from `model/roofline.py` (the server's dashboard uses them too).

Bound for a workload at decode batch B: prefill is compute-bound (2 FLOPs per matmul weight per prompt
token plus causal attention); every decode step reads all weights once (as stored: quantized weights count
their packed bytes and scales) plus the batch's KV cache, and does 2 FLOPs per weight per token plus
attention over the context, taking max(bytes / bandwidth, FLOPs / matmul rate). The matmul rate is the one of
the arithmetic the weights multiply in (`model.linear.arithmetic_dtype`: int8 for quantized weights on a CPU
with the kernels); attention's FLOPs are counted at that rate too, a bound on the safe side (they are ~6% of a
SmolLM2 step). Decode needs (output tokens / B) steps at the workload's mean decode context. Output tokens
over (prefill time + decode time) is the bound; achieved / bound is the fraction reported.

`python -m sluice.bench.roofline --save peaks.json` measures and saves the peaks, so a benchmark that shares
its machine with the server (a GPU) can measure before the server starts and pass the file along.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.model.config import ModelConfig, read_json_object
from sluice.model.roofline import Peaks, StepCost, attention_flops, kv_bytes_per_token, matmul_weights, measure_peaks

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ServedModel:
    """What the roofline needs of a served model: its shape, the bytes of weights a forward pass reads, the
    dtype of its KV pool, and the dtype its matmuls multiply in."""

    config: ModelConfig
    weight_bytes: float
    kv_dtype: str
    arithmetic: str

    @classmethod
    def of(cls, model: str | None, dtype: str, quantization: str, kv_cache_dtype: str = "auto") -> ServedModel:
        """`model` (a .gguf, an HF folder or None for the default) as `sluice serve --dtype --quantization
        --kv-cache-dtype` runs it on this machine; built from its metadata and abstract shapes, no weights read."""
        import jax.numpy as jnp
        from flax import nnx

        from sluice.model.linear import arithmetic_dtype
        from sluice.model.llama import Llama
        from sluice.model.quantize import quantize_model, resolve

        config, quantization = read_model_config(model), resolve(quantization)
        abstract = nnx.eval_shape(lambda: quantize_model(Llama(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)),
                                                         quantization))
        kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        return cls(config, StepCost.of(config, abstract, kv_dtype).weight_bytes, kv_dtype,
                   arithmetic_dtype(quantization, dtype))


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
    served: ServedModel,
    peaks: Peaks,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    batch: float,
) -> Roofline:
    """`peaks` measured in `served.arithmetic` (`peaks_from`)."""
    config = served.config
    weights = matmul_weights(config)
    batch = max(batch, 1.0)
    bandwidth, rate = peaks.bandwidth_gbs * 1e9, peaks.matmul_gflops * 1e9

    prompt_tokens = sum(prompt_lens)
    prefill_flops = 2 * weights * prompt_tokens + sum(attention_flops(config, p / 2) * p for p in prompt_lens)
    output_tokens = sum(output_lens)
    # Generated token i of a request attends to prompt + i keys; average over all generated tokens.
    context = sum(p * o + o * (o - 1) / 2 for p, o in zip(prompt_lens, output_lens)) / output_tokens

    step_bytes = served.weight_bytes + batch * context * kv_bytes_per_token(config, served.kv_dtype)
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
    from sluice.model.fetch import resolve_model

    source = resolve_model(model)
    if source.is_dir():
        return ModelConfig.from_hf(read_json_object(source / "config.json", missing_ok=False))
    import gguf

    reader = gguf.GGUFReader(str(source))
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return ModelConfig.from_gguf_fields(fields, tied_embeddings=all(t.name != "output.weight" for t in reader.tensors))


def peaks_from(path: Path | None, arithmetic: str = "float32") -> Peaks:
    """Peaks saved by `--save` (measured in the arithmetic asked for then), or measured now in `arithmetic`."""
    return Peaks.load(path) if path is not None else measure_peaks(dtype=arithmetic)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.roofline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", type=Path, default=None, help="write the measured peaks to this JSON file")
    parser.add_argument("--arithmetic", default="float32", choices=[*DTYPES, "int8"],
                        help="the dtype the served model's matmuls multiply in (int8: quantized weights on a CPU)")
    args = parser.parse_args()
    peaks = measure_peaks(dtype=args.arithmetic)
    print(f"{peaks.device}: memory bandwidth {peaks.bandwidth_gbs:.1f} GB/s, {args.arithmetic} matmul "
          f"{peaks.matmul_gflops:.0f} GFLOP/s")
    if args.save is not None:
        peaks.save(args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
