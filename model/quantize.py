"""Weight quantization: which modes exist, what "auto" means, and the quantizers into the kernels' layouts.

Modes (`load_model(quantization=...)`), GGUF's block formats with one scale per BLOCK = 32 consecutive inputs
of each output column:
- "none": weights in the model dtype.
- "int8": every linear weight and the embedding in Q8_0: q in [-127, 127], `w ~= q * scale`, scale float16.
- "int4": the layer weights in Q4_1: q in [0, 15], `w ~= q * scale + min`, scale and min float16; the embedding
  / LM head in Q8_0.
Both are GGUF's own numbers: quantizing the dequantized values of a Q4_1 (or Q8_0) GGUF tensor gives back its
values, scales and mins exactly, so converting SmolLM2's Q4_1 / Q8_0 file to "int4" loses nothing.
Where the CPU kernels run, the values are stored packed for them (`pallas_kernels/cpu_qmatmul.py`): a weight
`[*lead, K, *N]` (lead: the stacked layer axis, K: the input axis) becomes `[*lead, *N_outer, N_last/16, K/pack,
16, 4]` and its scales `[*lead, *N_outer, N_last/16, K/32, 16]` (`packed_order` gives the axis order).
Elsewhere (a GPU) "int8" stores each weight per output channel instead: values int8 in the float weight's own
shape, and one float32 scale per output feature (the float shape without K). XLA:GPU reads that form in place,
its int8 -> float conversion fused into the matmul, and applies the scale to the product; GGUF's blocks along K
would be dequantized into a float copy of the weight at every step (`bench.step_audit --target h100`). int4
keeps the packed form everywhere. How each form is multiplied is `model.linear`'s business.

The quantizers are jnp functions, so `quantize_model` also runs under `nnx.eval_shape` (the loader builds its
restore target that way).
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from sluice.model.llama import LAYER_PARAMS, LINEAR_WEIGHTS, Llama
from sluice.pallas_kernels import cpu_build, cpu_library, cpu_qmatmul
from sluice.pallas_kernels.cpu_qmatmul import BLOCK, PANEL, pack_q4, pack_q8, pack_scales

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "int4")
CHOICES = QUANTIZATIONS + ("auto",)
AUTO = {"cpu": "int4"}
"""What "auto" picks per backend (bench/quant.py, bench/RESULTS.md). CPU: int4 reads the fewest bytes per
decode step and multiplies as fast as int8 in the VNNI kernels, and for a 4-bit GGUF it is the file's own
weights. Elsewhere "none", the float weights every GPU figure was measured with. On a GPU, int8's per-channel form
compiles to matmuls that read the int8 weights in place (half the bf16 bytes; `bench.step_audit --target h100
--quantization int8`), but it has not been timed on a GPU yet (`gpu_check --quantization int8`). A CPU without
the kernels takes "none" too: there the dequantized form is several times slower than float weights. So does a CPU
with only the kernels' portable build (SIMDe; ARM64): correct, but not yet timed on the CPUs it is for."""

T = TypeVar("T")


def default_layout(quantization: str) -> str:
    """How `quantization`'s weights are stored here: "channel" for int8 where the CPU kernels do not run (a GPU),
    else "packed" (module docstring)."""
    return "channel" if quantization == "int8" and not cpu_qmatmul.available() else "packed"


def resolve(quantization: str, backend: str | None = None, cpu_kernels: bool | None = None) -> str:
    """A mode from CHOICES -> one of QUANTIZATIONS for `backend` (default: JAX's), "auto" on a CPU depending on
    whether the CPU matmul kernels run in a measured build (`cpu_kernels`, default: `_measured_kernels()`)."""
    if quantization not in CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {', '.join(CHOICES)}")
    if quantization != "auto":
        return quantization
    backend = backend or jax.default_backend()
    if backend == "cpu" and not (_measured_kernels() if cpu_kernels is None else cpu_kernels):
        return "none"
    return AUTO.get(backend, "none")


def _measured_kernels() -> bool:
    """Whether the CPU matmul kernels run here in an x86 build (saying once why "auto" takes float weights if not)."""
    if not cpu_qmatmul.available():
        _say_auto_takes_float_weights("the CPU matmul kernels being unavailable (int4 and int8 without them are "
                                      "several times slower)")
        return False
    if cpu_library.load().variant is cpu_build.PORTABLE:
        _say_auto_takes_float_weights("the CPU matmul kernels' portable build not being timed on this CPU yet "
                                      "(--quantization int4 or int8 takes it)")
        return False
    return True


@functools.cache
def _say_auto_takes_float_weights(why: str) -> None:
    logger.warning('--quantization auto: float weights ("none"), %s', why)


def packed_order(name: str, axes: Sequence[T]) -> tuple[T, ...]:
    """The axes of the float weight `name` (its shape, or its partition spec) in the packed layout's order:
    lead (layer) axes, output axes, then the input axis. The layout's trailing [16, 4] (values) or [16]
    (scales) are not included; the last output axis counts panels of 16 there."""
    k, lead = LINEAR_WEIGHTS[name], 1 if name in LAYER_PARAMS else 0
    outputs = [a for i, a in enumerate(axes) if i >= lead and i != k]
    return (*axes[:lead], *outputs, axes[k])


def _blocks(w: jax.Array) -> jax.Array:
    """[K, *N] -> [K / BLOCK, BLOCK, *N] f32, checking the shapes the packed layouts need."""
    k, *outputs = w.shape
    if k % BLOCK or outputs[-1] % PANEL:
        raise ValueError(f"quantized weights need inputs in multiples of {BLOCK} and outputs of {PANEL}, got {w.shape}")
    return jnp.asarray(w, jnp.float32).reshape(k // BLOCK, BLOCK, *outputs)


def quantize_q8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [K, *N] float -> Q8_0 packed: (values int8, scale f16)."""
    blocks = _blocks(w)
    scale = (jnp.max(jnp.abs(blocks), axis=1) / 127.0).astype(jnp.float16)
    step = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))
    q = jnp.clip(jnp.round(blocks / step[:, None]), -127, 127).astype(jnp.int8).reshape(w.shape)
    return pack_q8(q), pack_scales(scale)


def quantize_q4(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w [K, *N] float -> Q4_1 packed: (values uint8, scale f16, min f16)."""
    blocks = _blocks(w)
    low = blocks.min(axis=1).astype(jnp.float16)
    scale = ((blocks.max(axis=1) - low.astype(jnp.float32)) / 15.0).astype(jnp.float16)
    step = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))
    q = jnp.round((blocks - low.astype(jnp.float32)[:, None]) / step[:, None])
    q = jnp.clip(q, 0, 15).astype(jnp.uint8).reshape(w.shape)
    return pack_q4(q), pack_scales(scale), pack_scales(low)


def quantize_per_channel(w: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """w float with its input axis at `k` -> (values int8 of w's shape, scale float32 [w's shape without k]):
    `w ~= values * scale` broadcast along k, symmetric, q in [-127, 127]."""
    w = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=k) / 127.0
    step = jnp.expand_dims(jnp.where(scale == 0, 1.0, scale), k)
    return jnp.clip(jnp.round(w / step), -127, 127).astype(jnp.int8), scale


def quantize_weight(name: str, w: jax.Array, quantization: str, layout: str = "packed") -> dict[str, jax.Array]:
    """The float weight `name` -> its params in `quantization` stored in `layout` ("packed" or "channel",
    `default_layout`): `name` (values), `name_scale`, and for int4 layer weights `name_min`."""
    k, lead = LINEAR_WEIGHTS[name], 1 if name in LAYER_PARAMS else 0
    if layout == "channel" and quantization == "int8":
        return dict(zip((name, f"{name}_scale"), quantize_per_channel(w, k)))
    w = jnp.moveaxis(jnp.asarray(w), k, lead)  # [*lead, K, *N]
    four_bit = quantization == "int4" and name in LAYER_PARAMS
    quantize = quantize_q4 if four_bit else quantize_q8
    for _ in range(lead):
        quantize = jax.vmap(quantize)
    parts = quantize(w)
    return dict(zip((name, f"{name}_scale", f"{name}_min"), parts))


def quantize_params(params: dict[str, jax.Array], quantization: str, layout: str | None = None
                    ) -> dict[str, jax.Array]:
    """Float params by name (`Llama`'s) -> the params of that mode, in `layout` (default: `default_layout`).
    "none" returns them as they are."""
    if quantization == "none":
        return dict(params)
    layout = layout or default_layout(quantization)
    out = {}
    for name, value in params.items():
        out.update(quantize_weight(name, value, quantization, layout) if name in LINEAR_WEIGHTS else {name: value})
    return out


def quantize_model(model: Llama, quantization: str, layout: str | None = None) -> Llama:
    """Replaces `model`'s float weights by their quantized form in `layout` (in place) and returns it."""
    params = {path[0]: var[...] for path, var in nnx.to_flat_state(nnx.state(model))}
    for name, value in quantize_params(params, quantization, layout).items():
        setattr(model, name, nnx.Param(value))
    return model
