"""Weight quantization: which modes exist, what "auto" means on each backend, and the quantizers.

Modes (`load_model(quantization=...)`):
- "none": weights in the model dtype.
- "int8": every linear weight and the embedding int8, symmetric, one float32 scale per output channel
  (`w ~= q * scale`, q in [-127, 127]; the scale has the weight's shape without its input axis).
- "int4": the layer weights 4-bit, asymmetric, one scale and one min per GROUP consecutive inputs of each
  output channel (`w ~= q * scale + min`, q in [0, 15], GGUF Q4_1's numbers in Sluice's layout: two values per
  byte along the input axis, even inputs in the low nibble; scale and min float16 with the input axis divided
  by GROUP); the embedding / LM head int8 as above. Quantizing the dequantized values of a Q4_1 GGUF gives
  back its own values, scales and mins, so that conversion loses nothing.
Activations stay in the model dtype (weight-only quantization): `model.linear` widens the weights.

The quantizers are jnp functions, so `quantize_model` also runs under `nnx.eval_shape` (the loader builds its
restore target that way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.llama import LINEAR_WEIGHTS, Llama
from pallas_kernels.cpu_qmatmul import GROUP

QUANTIZATIONS = ("none", "int8", "int4")
CHOICES = QUANTIZATIONS + ("auto",)
AUTO = {"cpu": "int8", "gpu": "int8"}
"""What "auto" picks per backend, from bench/quant.py (bench/RESULTS.md). CPU: int8 steps fastest at every
batch size measured (its kernel does less work per weight than int4's, which does not read few enough bytes
fewer to make up for it on 2 cores, and int4's prefill pays for unpacking), within 0.2% of float32's
perplexity. GPU: int8 weight-only halves bf16's bytes without a kernel of our own."""


def resolve(quantization: str, backend: str | None = None) -> str:
    """A mode from CHOICES -> one of QUANTIZATIONS for `backend` (default: JAX's)."""
    if quantization not in CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {', '.join(CHOICES)}")
    if quantization != "auto":
        return quantization
    return AUTO.get(backend or jax.default_backend(), "none")


def quantize_int8(w: jax.Array, k_axis: int) -> tuple[jax.Array, jax.Array]:
    """w float -> (q int8 like w, scale float32 = w's shape without k_axis)."""
    w = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=k_axis) / 127.0
    scale = jnp.where(scale == 0.0, 1.0, scale)
    q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, k_axis)), -127, 127)
    return q.astype(jnp.int8), scale


def quantize_int4(w: jax.Array, k_axis: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w float (k_axis a multiple of GROUP) -> (packed uint8, k halved; scale, min f16, k divided by GROUP)."""
    w = jnp.moveaxis(jnp.asarray(w, jnp.float32), k_axis, 0)
    k = w.shape[0]
    if k % GROUP:
        raise ValueError(f"int4 needs the input dimension ({k}) to be a multiple of {GROUP}")
    groups = w.reshape(k // GROUP, GROUP, *w.shape[1:])
    low = groups.min(axis=1).astype(jnp.float16)
    step = ((groups.max(axis=1) - low.astype(jnp.float32)) / 15.0).astype(jnp.float16)
    step32 = jnp.where(step == 0, 1.0, step.astype(jnp.float32))
    q = jnp.round((groups - low.astype(jnp.float32)[:, None]) / step32[:, None])
    q = jnp.clip(q, 0, 15).astype(jnp.uint8).reshape(w.shape)
    packed = q[0::2] | (q[1::2] << 4)
    return tuple(jnp.moveaxis(a, 0, k_axis) for a in (packed, step, low))


def quantize_params(params: dict[str, jax.Array], quantization: str) -> dict[str, jax.Array]:
    """Float params by name (`Llama`'s) -> the params of that mode: each quantized weight `name` replaced by
    its values, plus `name_scale` (and `name_min` for int4). "none" returns them as they are."""
    if quantization == "none":
        return dict(params)
    out = {}
    for name, value in params.items():
        if name not in LINEAR_WEIGHTS:
            out[name] = value
        elif quantization == "int4" and name not in ("embed", "lm_head"):
            out[name], out[f"{name}_scale"], out[f"{name}_min"] = quantize_int4(value, LINEAR_WEIGHTS[name])
        else:
            out[name], out[f"{name}_scale"] = quantize_int8(value, LINEAR_WEIGHTS[name])
    return out


def quantize_model(model: Llama, quantization: str) -> Llama:
    """Replaces `model`'s float weights by their quantized form (in place) and returns it."""
    params = {path[0]: var[...] for path, var in nnx.to_flat_state(nnx.state(model))}
    for name, value in quantize_params(params, quantization).items():
        setattr(model, name, nnx.Param(value))
    return model
