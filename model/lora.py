"""LoRA adapters as PEFT saves them, read (`load_adapter`) and given to a `Llama` (`attach_adapters`), several served
in one batch: each token names its adapter by a slot.

A PEFT folder holds adapter_config.json and adapter_model.safetensors, whose tensors
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]` and `....lora_B.weight` `[out, r]`
(the `base_model.model.` prefix optional, as vLLM reads them) add `scaling * B @ A` to the weight `[out, in]` of
q/k/v/o_proj and gate/up/down_proj; scaling is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with use_rslora.

Layout. Each projection the adapters add to (`llama.LORA_TARGETS`) gets, over S = max_loras slots padded to rank R
with zeros, with P the modules fused in it (q/k/v: 3, gate/up: 2, o and down: 1) and C = R * P columns a slot:
- `{name}_lora_a` `[L, K, S, C]`: slot s's column r * P + p is lora_A row r of its adapter's module p;
- `{name}_lora_b` `[L, S, C, *N]`: row r * P + p is lora_B column r of module p, times the scaling, laid into the
  fused weight's output axes `*N` as the loader lays the base weights (`_fuse`: wqkv's
  `[num_kv_heads, (q_per_kv + 2) * head_dim]`, w_gate_up's `[2, intermediate]`), zeros in the other modules' places.
So B is block-structured, and the adapters' (HF-ordered) rows land on the base weight's (HF-ordered, a GGUF's Q/K
rows unpermuted by the loader) features. A slot with no adapter, or an adapter that leaves a module or a layer
(layers_to_transform) out, is zeros there; an adapter adds only to the projections some adapter targets.

The mask. A token's delta is `((x @ A) * own) @ B` (`llama.lora_delta`): x `[T, K]` times every slot's A, the
columns of every slot other than the token's own zeroed (`own`, the one-hot of its slot: all zeros for -1, the base
model), times B. Two small dense matmuls a projection, whatever the mix of adapters in the batch, and no weights
gathered per token. x is the projection's input as the base weight multiplies it: the RMSNorm's output for q/k/v and
gate/up, as PEFT adds LoRA to the normed hidden states.

Refused, each in one line naming the adapter (`LoraError`), as vLLM refuses it or where Sluice would be wrong: another
PEFT method than LoRA, DoRA (use_dora), trained biases (bias other than "none", lora_bias), modules_to_save, targets
other than the seven projections (lm_head, embed_tokens, ...), per-module ranks or alphas (rank_pattern,
alpha_pattern), tensors Sluice would not apply, weights that do not fit the model (shape, layer), a folder without
adapter_config.json or adapter_model.safetensors (an adapter_model.bin alone: convert it), and malformed files.
Served: target_modules as a list, "all-linear", or a regex (resolved by the weights the file holds);
layers_to_transform (the other layers are zeros); fan_in_fan_out, which PEFT sets only for transposed (Conv1D) base
weights and which leaves lora_A `[r, in]` and lora_B `[out, r]` as they are.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sluice.model.config import ModelConfig, read_json_object
from sluice.model.llama import LORA_TARGETS, Llama, fuse_qkv, lora_names
from sluice.model.loader import ShardingRule
from sluice.model.weights import LAYER_TENSORS, expected_shape

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate", "up_proj": "w_up",
           "down_proj": "w_down"}
"""The modules an adapter may target -> their weight's name in `model.weights` (`LAYER_TENSORS`, `expected_shape`)."""
FUSED = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",), "w_gate_up": ("gate_proj", "up_proj"),
         "w_down": ("down_proj",)}
"""Each projection of `llama.LORA_TARGETS` -> its modules, in the order the columns of a slot cycle through them."""
ALL_LINEAR = "all-linear"
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
_MODULE_PATHS = {LAYER_TENSORS[weight][1].removesuffix(".weight"): module for module, weight in MODULES.items()}
"""HF's path of each module within a layer ("self_attn.q_proj") -> the module."""


class LoraError(ValueError):
    """An adapter Sluice cannot serve; the message, one line, names it and what is wrong."""


Refuse = Callable[[str], LoraError]
"""why -> the LoraError naming the adapter being read."""


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter as read, checked against the model it is for. `a` and `b`: by module ("q_proj"), in the
    orientation Sluice multiplies (`x @ w`), float32, stacked over the model's layers (zeros for layers it leaves
    out): lora_A as `[L, in, rank]`, lora_B as `[L, rank, out]`, not scaled."""

    name: str
    path: Path
    rank: int
    scaling: float
    fingerprint: str  # sha256 of the config file's and the weights file's sha256s: equal files, equal fingerprint
    a: Mapping[str, np.ndarray] = field(repr=False, compare=False)
    b: Mapping[str, np.ndarray] = field(repr=False, compare=False)


def load_adapter(name: str, path: str | Path, config: ModelConfig) -> LoraAdapter:
    """Reads the PEFT folder at `path` as adapter `name` for the model of `config`; LoraError (module docstring) if
    Sluice cannot serve it on that model."""
    folder = Path(path)

    def refuse(why: str) -> LoraError:
        return LoraError(f"LoRA adapter {name!r} ({folder}): {why}")

    if not folder.is_dir():
        raise refuse("no such folder")
    try:
        settings = read_json_object(folder / CONFIG_FILE, missing_ok=False)
    except ValueError as error:
        raise refuse(str(error)) from None
    rank, scaling = _check_settings(settings, refuse)
    if not (folder / WEIGHTS_FILE).is_file():
        bin_only = (folder / "adapter_model.bin").is_file()
        raise refuse(f"has adapter_model.bin, a pickle Sluice does not read: convert it to {WEIGHTS_FILE}" if bin_only
                     else f"has no {WEIGHTS_FILE}")
    data = (folder / WEIGHTS_FILE).read_bytes()
    tensors = _read_safetensors(data, refuse)
    modules = _targets(settings.get("target_modules"), tensors, refuse)
    layers = _layers(settings.get("layers_to_transform"), config, refuse)
    a, b = _stack(tensors, modules, layers, rank, config, refuse)
    digests = [hashlib.sha256(content).digest() for content in ((folder / CONFIG_FILE).read_bytes(), data)]
    return LoraAdapter(name, folder, rank, scaling, hashlib.sha256(b"".join(digests)).hexdigest(), a, b)


def _check_settings(settings: Mapping[str, Any], refuse: Refuse) -> tuple[int, float]:
    """(rank, scaling) of adapter_config.json's `settings`, or `refuse`'s error for what Sluice does not serve."""
    unsupported = [
        (settings.get("peft_type", "LORA") != "LORA", f"is a {settings.get('peft_type')} adapter, not LoRA"),
        (settings.get("use_dora"), "uses DoRA (use_dora), which Sluice does not serve"),
        (settings.get("bias", "none") != "none" or settings.get("lora_bias"),
         f"trains biases (bias {settings.get('bias')!r}, lora_bias {settings.get('lora_bias')}), which Sluice does "
         f"not serve"),
        (settings.get("modules_to_save"),
         f"saves whole modules (modules_to_save {settings.get('modules_to_save')}), which Sluice does not serve"),
    ] + [(settings.get(key), f"has a {key} (a rank or alpha of its own for some modules), which Sluice does not "
                             f"serve") for key in ("rank_pattern", "alpha_pattern")]
    for refused, why in unsupported:
        if refused:
            raise refuse(why)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", 8)  # PEFT's default alpha
    if not (isinstance(rank, int) and rank >= 1) or isinstance(rank, bool):
        raise refuse(f"has r {rank!r}, not a rank of at least 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse(f"has lora_alpha {alpha!r}, not a number")
    return rank, alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _read_safetensors(data: bytes, refuse: Refuse) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file's bytes, float32."""
    from safetensors import SafetensorError
    from safetensors.flax import load  # flax reads bfloat16, which plain numpy cannot

    try:
        return {key: np.asarray(value, np.float32) for key, value in load(data).items()}
    except SafetensorError as error:
        raise refuse(f"{WEIGHTS_FILE} does not read as safetensors (cut short or corrupt): {error}") from None


def _targets(target_modules: Any, tensors: Mapping[str, np.ndarray], refuse: Refuse) -> set[str]:
    """The modules (`MODULES`) the adapter adds to: target_modules' list (by the last part of each name), all seven
    for "all-linear", those the weights hold for a regex or none given."""
    if isinstance(target_modules, list):
        targets = {str(target).rsplit(".", 1)[-1] for target in target_modules}
        if unserved := sorted(targets - MODULES.keys()):
            raise refuse(f"targets {', '.join(unserved)}, which Sluice does not serve (only {', '.join(MODULES)})")
        return targets
    if target_modules == ALL_LINEAR:
        return set(MODULES)
    return {_MODULE_PATHS.get(match[2]) for match in map(_KEY.fullmatch, tensors) if match} - {None}


def _layers(layers_to_transform: Any, config: ModelConfig, refuse: Refuse) -> list[int]:
    """The layers the adapter transforms: layers_to_transform's (an index or a list), or all."""
    if layers_to_transform is None:
        return list(range(config.num_layers))
    layers = [layers_to_transform] if isinstance(layers_to_transform, int) else layers_to_transform
    if not all(isinstance(layer, int) and 0 <= layer < config.num_layers for layer in layers):
        raise refuse(f"has layers_to_transform {layers_to_transform}, but the model has {config.num_layers} layers")
    return sorted(set(layers))


def _stack(tensors: Mapping[str, np.ndarray], modules: set[str], layers: list[int], rank: int,
           config: ModelConfig, refuse: Refuse) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`LoraAdapter.a` and `.b` of `modules` over `layers` from the file's `tensors`: each of them, and nothing else,
    in the shape the model and `rank` imply."""
    wanted = {}
    for module in modules:
        out_features, in_features = expected_shape(MODULES[module], config)
        path = next(path for path, found in _MODULE_PATHS.items() if found == module)
        for layer in layers:
            prefix = f"model.layers.{layer}.{path}"
            wanted[prefix + ".lora_A.weight"] = (module, layer, (rank, in_features))
            wanted[prefix + ".lora_B.weight"] = (module, layer, (out_features, rank))
    found = {key.removeprefix("base_model.model."): tensor for key, tensor in tensors.items()}
    if unserved := sorted(found.keys() - wanted.keys()):
        more = f" and {len(unserved) - 1} more" if len(unserved) > 1 else ""
        raise refuse(f"holds {unserved[0]}{more}, which Sluice does not serve on this {config.num_layers}-layer model "
                     f"(it serves {', '.join(sorted(modules))} on layers {layers})")
    if not wanted:
        raise refuse("holds no LoRA weights for the modules Sluice serves")
    if missing := sorted(wanted.keys() - found.keys()):
        raise refuse(f"lacks {missing[0]}, which its adapter_config.json implies")
    a = {module: np.zeros((config.num_layers, expected_shape(MODULES[module], config)[1], rank), np.float32)
         for module in modules}
    b = {module: np.zeros((config.num_layers, rank, expected_shape(MODULES[module], config)[0]), np.float32)
         for module in modules}
    for key, (module, layer, shape) in wanted.items():
        if found[key].shape != shape:
            raise refuse(f"{key} has shape {list(found[key].shape)}, but the model and r {rank} imply {list(shape)}")
        (a if key.endswith("lora_A.weight") else b)[module][layer] = found[key].T
    return a, b


def attach_adapters(model: Llama, adapters: Sequence[LoraAdapter], max_loras: int, max_rank: int,
                    sharding_rule: ShardingRule | None = None) -> None:
    """Gives `model` the LoRA parameters of `adapters` (module docstring), adapter i in slot i of `max_loras`, each
    padded to rank `max_rank`, in the model's activation dtype (quantized base weights or not), stored as its other
    layer parameters are (stacked, or one array per layer). `sharding_rule` places each (tensor parallelism:
    `sharding.rules.param_sharding` with the model's mesh; default: the first device). Replaces what an earlier
    call attached. LoraError for more adapters than slots, or an adapter's rank above max_rank."""
    if len(adapters) > max_loras:
        raise LoraError(f"{len(adapters)} LoRA adapters ({', '.join(a.name for a in adapters)}) do not fit in "
                        f"{max_loras} slots (max_loras)")
    for adapter in adapters:
        if adapter.rank > max_rank:
            raise LoraError(f"LoRA adapter {adapter.name!r} ({adapter.path}) has rank {adapter.rank}, above the "
                            f"largest served, {max_rank} (max_lora_rank)")
    for name in (name for weight in LORA_TARGETS for name in lora_names(weight)):
        if hasattr(model, name):
            delattr(model, name)
    stacks = lora_stacks(adapters, model.config, max_loras, max_rank)
    shardings = {} if sharding_rule is None else sharding_rule(model.config, {n: s.shape for n, s in stacks.items()})
    for name, stack in stacks.items():
        model.set_layer_param(name, jax.device_put(stack.astype(model.dtype), shardings.get(name)))


def lora_stacks(adapters: Sequence[LoraAdapter], config: ModelConfig, max_loras: int, max_rank: int
                ) -> dict[str, np.ndarray]:
    """The LoRA parameters of `adapters` (module docstring), float32, for the projections any of them targets:
    `{name}_lora_a` `[L, K, S, C]` and `{name}_lora_b` `[L, S, C, *N]`, S = max_loras, C = max_rank * P."""
    lead = (config.num_layers, max_loras, max_rank)
    targeted = {module for adapter in adapters for module in adapter.a}
    stacks = {}
    for fused, modules in FUSED.items():
        if targeted.isdisjoint(modules):
            continue
        in_features = expected_shape(MODULES[modules[0]], config)[1]
        a = np.zeros((config.num_layers, in_features, *lead[1:], len(modules)), np.float32)  # [L, K, S, R, P]
        rows = [np.zeros((*lead, expected_shape(MODULES[module], config)[0]), np.float32) for module in modules]
        for slot, adapter in enumerate(adapters):
            for part, module in enumerate(modules):
                if module in adapter.a:
                    a[:, :, slot, :adapter.rank, part] = adapter.a[module]
                    rows[part][:, slot, :adapter.rank] = adapter.b[module] * adapter.scaling
        # Each module's rows of B laid into the output axes alone, the other modules' places zeros: [L, S, R, P, *N].
        b = np.stack([_fuse(fused, [r if i == part else np.zeros_like(r) for i, r in enumerate(rows)], config)
                      for part in range(len(modules))], axis=3)
        a_name, b_name = lora_names(fused)
        stacks[a_name] = a.reshape(*a.shape[:3], -1)
        stacks[b_name] = b.reshape(*lead[:2], -1, *b.shape[4:])
    return stacks


def _fuse(fused: str, parts: list[np.ndarray], config: ModelConfig) -> np.ndarray:
    """The modules of projection `fused` (`FUSED`), each `[..., out]` -> `[..., *N]` in its output layout, as the
    loader lays the base weights (`weights.fuse_projections`)."""
    if fused == "wqkv":
        return fuse_qkv(*parts, config)
    if fused == "w_gate_up":
        return np.stack(parts, axis=-2)
    return parts[0]
