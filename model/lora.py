"""LoRA adapters as PEFT saves them, read (`load_adapter`) and given to a `Llama` (`attach_adapters`), several served
in one batch: each token names its adapter by a slot.

A PEFT folder holds adapter_config.json and adapter_model.safetensors, whose tensors
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]` and `....lora_B.weight` `[out, r]`
(the `base_model.model.` prefix optional, as vLLM reads them) add `scaling * B @ A` to the weight `[out, in]` of
q/k/v/o_proj and gate/up/down_proj; scaling is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with use_rslora.

Layout. Over S = max_loras slots, each adapter padded to rank R with zeros, each projection some adapter adds to
(`llama.LORA_MODULES`: wqkv of q/k/v_proj, wo of o_proj, w_gate_up of gate/up_proj, w_down of down_proj) gets
- its A `{name}_lora_a` `[L, S, K, P, R]`, P the modules fused in it: [l, s, :, p, :r] is lora_A transposed of module
  p of slot s's adapter (zeros if it leaves that module of that layer out);
- a B `{module}_lora_b` `[L, S, R, out]` for each of those modules: [l, s, :r] is its lora_B transposed, times the
  adapter's scaling.
The modules' deltas `[T, out]` are then laid into the projection's fused output as the base weights are
(`llama.fuse_outputs`: a GGUF's Q/K rows are permuted back to HF's order by the loader, so an HF adapter's rows land
on the features they were trained for).
A slot's part of each (`slot_weights`, kept in host memory for every adapter served, or with --max-cpu-loras read
again when dropped) is what is written into a slot to swap an adapter in (`batching.lora_slots`). A server that loads
adapters while it runs (vLLM's runtime LoRA updating) holds all seven projections' parameters from the start, zeros
in the slots no adapter fills.

The mask. A token's delta is `((x @ A) * own) @ B` (`llama.lora_delta`): x `[T, K]` times every slot's A, the
columns of every slot other than the token's own zeroed (`own`, the one-hot of its slot: all zeros for -1, the base
model), times each module's B. Dense matmuls of a few columns, whatever the mix of adapters in the batch, and no
weights gathered per token; each token multiplies all S slots' weights, so the cost grows with max_loras. On a CPU
a step's tokens choose (`llama.with_lora`): of no adapter, the plain projections; of one, that slot's weights alone
(slot-major A, so they are contiguous). x is the projection's input as the base weight multiplies it: the RMSNorm's
output for q/k/v and gate/up, as PEFT adds LoRA to the normed hidden states.

Refused, each in one line naming the adapter (`LoraError`), as vLLM refuses it or where Sluice would be wrong: another
PEFT method than LoRA, trained biases (bias other than "none", lora_bias), the LoRA variants Sluice does not compute
(`VARIANTS`, when set: DoRA (use_dora), modules_to_save, per-module ranks or alphas (rank_pattern, alpha_pattern),
Activated LoRA (alora_invocation_tokens), QALoRA (use_qalora), BD-LoRA (use_bdlora), Arrow (arrow_config),
target_parameters, layer_replication, trainable_token_indices), targets other than the seven projections (lm_head,
embed_tokens, ...), tensors Sluice would not apply, a module's lora_A without its lora_B or the other way round,
weights that do not fit the model (shape, layer, r), a file given for the folder, a folder without adapter_config.json
or adapter_model.safetensors (an adapter_model.bin alone: convert it), and malformed files.
Served: target_modules as a list, "all-linear", or a regex; exclude_modules; layers_to_transform and layers_pattern;
fan_in_fan_out, which PEFT sets only for transposed (Conv1D) base weights and which leaves lora_A `[r, in]` and
lora_B `[out, r]` as they are. Where adapter_config.json alone says which modules of which layers the adapter adds to
(target_modules "all-linear" or a list of module names, perhaps with layers_to_transform), the file must hold each;
otherwise (a regex, a list entry with a path such as "model.layers.0.self_attn.q_proj", exclude_modules,
layers_pattern) the file's tensors say which. Either way the modules and layers it leaves out are zeros.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sluice.model.config import ModelConfig, read_json_object
from sluice.model.llama import LORA_MODULES, LORA_PARAMS, Llama, lora_a, lora_b
from sluice.model.loader import ShardingRule
from sluice.model.weights import LAYER_TENSORS, expected_shape

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate", "up_proj": "w_up",
           "down_proj": "w_down"}
"""The modules an adapter may target -> their weight's name in `model.weights` (`LAYER_TENSORS`, `expected_shape`)."""
MODULE_PATHS = {module: LAYER_TENSORS[weight][1].removesuffix(".weight") for module, weight in MODULES.items()}
"""Each module -> HF's path of it within a layer ("self_attn.q_proj")."""
ALL_LINEAR = "all-linear"
VARIANTS = {
    "use_dora": "DoRA: a magnitude of its own for each output feature",
    "modules_to_save": "whole modules saved beside the adapter",
    "rank_pattern": "a rank of their own for some modules",
    "alpha_pattern": "an alpha of their own for some modules",
    "alora_invocation_tokens": "Activated LoRA: applied only from its invocation tokens on",
    "use_qalora": "QALoRA: its input pooled in groups",
    "use_bdlora": "BD-LoRA: block-diagonal lora_A or lora_B",
    "arrow_config": "Arrow: several adapters, routed per token",
    "target_parameters": "LoRA on parameters rather than modules, as on MoE experts",
    "layer_replication": "layers repeated: a deeper model than the base",
    "trainable_token_indices": "the embeddings of some tokens trained",
}
"""adapter_config.json's fields of the LoRA variants Sluice does not compute -> what each does; refused when set (not
null, false nor empty: PEFT's defaults are null, false or {})."""


class LoraError(ValueError):
    """An adapter Sluice cannot serve; the message, one line, names it and what is wrong."""


class AdapterNotFound(LoraError):
    """No adapter at the path given: nothing there."""


Refuse = Callable[[str], LoraError]
"""why -> the LoraError naming the adapter being read."""

Pairs = dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]
"""(module, layer) -> its lora_A `[r, in]` and lora_B `[out, r]`, as the file holds them."""


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter as read, checked against the model it is for. `a` and `b`: by module ("q_proj"), in the
    orientation Sluice multiplies (`x @ w`), float32, stacked over the model's layers (zeros for the layers it leaves
    out of that module): lora_A as `[L, in, rank]`, lora_B as `[L, rank, out]`, not scaled; only the modules it adds
    to on some layer."""

    name: str
    path: Path
    rank: int
    scaling: float
    fingerprint: str  # sha256 of the config file's and the weights file's sha256s: equal files, equal fingerprint
    a: Mapping[str, np.ndarray] = field(repr=False, compare=False)
    b: Mapping[str, np.ndarray] = field(repr=False, compare=False)


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int | None = None) -> LoraAdapter:
    """Reads the PEFT folder at `path` as adapter `name` for the model of `config`; LoraError (module docstring) if
    Sluice cannot serve it on that model, or its rank is above `max_rank` (None: any), said before its weights are
    read."""
    folder = Path(path)

    def refuse(why: str, kind: type[LoraError] = LoraError) -> LoraError:
        return kind(f"LoRA adapter {name!r} ({folder}): {why}")

    try:
        folder = folder.expanduser()  # `~/adapters/x`, as a model's path and vLLM's lora_path take it
    except RuntimeError:  # `~user` of no such user
        raise refuse("no such folder", AdapterNotFound) from None
    try:
        is_folder = folder.is_dir()
        found = is_folder or folder.exists()
    except OSError as error:  # a name too long for the file system
        raise refuse(f"no such folder ({error.strerror})", AdapterNotFound) from None
    if not found:
        raise refuse("no such folder", AdapterNotFound)
    if not is_folder:
        raise refuse(f"is a file, not a folder: give the PEFT adapter's folder, which holds {CONFIG_FILE}")
    try:
        settings = read_json_object(folder / CONFIG_FILE, missing_ok=False)
    except ValueError as error:
        raise refuse(str(error)) from None
    rank, scaling = _check_settings(settings, refuse)
    if max_rank is not None and rank > max_rank:
        raise refuse(f"has rank {rank}, above the largest served, {max_rank} (max_lora_rank)")
    if not (folder / WEIGHTS_FILE).is_file():
        bin_only = (folder / "adapter_model.bin").is_file()
        raise refuse(f"has adapter_model.bin, a pickle Sluice does not read: convert it to {WEIGHTS_FILE}" if bin_only
                     else f"has no {WEIGHTS_FILE}")
    data = (folder / WEIGHTS_FILE).read_bytes()
    modules = _targets(settings.get("target_modules"), refuse)
    layers = _layers(settings.get("layers_to_transform"), config, refuse)
    pairs = _pairs(_read_safetensors(data, refuse), modules, layers, _config_decides(settings), config, refuse)
    _check_shapes(pairs, rank, config, refuse)  # before anything is allocated for them: r may be any number
    a, b = _stack(pairs, rank, config)
    digests = [hashlib.sha256(content).digest() for content in ((folder / CONFIG_FILE).read_bytes(), data)]
    return LoraAdapter(name, folder, rank, scaling, hashlib.sha256(b"".join(digests)).hexdigest(), a, b)


def _check_settings(settings: Mapping[str, Any], refuse: Refuse) -> tuple[int, float]:
    """(rank, scaling) of adapter_config.json's `settings`, or `refuse`'s error for what Sluice does not serve."""
    unsupported = [
        (settings.get("peft_type", "LORA") != "LORA", f"is a {settings.get('peft_type')} adapter, not LoRA"),
        (settings.get("bias", "none") != "none" or settings.get("lora_bias"),
         f"trains biases (bias {settings.get('bias')!r}, lora_bias {settings.get('lora_bias')}), which Sluice does "
         f"not serve"),
    ] + [(settings.get(key), f"sets {key} ({what}), which Sluice does not serve") for key, what in VARIANTS.items()]
    for refused, why in unsupported:
        if refused:
            raise refuse(why)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", 8)  # PEFT's default alpha
    if not (isinstance(rank, int) and rank >= 1) or isinstance(rank, bool):
        raise refuse(f"has r {rank!r}, not a rank of at least 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise refuse(f"has lora_alpha {alpha!r}, not a finite number")
    return rank, alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _read_safetensors(data: bytes, refuse: Refuse) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file's bytes, float32."""
    from safetensors import SafetensorError
    from safetensors.flax import load  # flax reads bfloat16, which plain numpy cannot

    try:
        tensors = {key: np.asarray(value, np.float32) for key, value in load(data).items()}
    except SafetensorError as error:
        raise refuse(f"{WEIGHTS_FILE} does not read as safetensors (cut short or corrupt): {error}") from None
    # A NaN or inf would reach every token of a step that holds its adapter's (masking multiplies it by 0).
    if bad := next((key for key, tensor in tensors.items() if not np.isfinite(tensor).all()), None):
        raise refuse(f"{bad} holds values that are not finite (NaN or inf)")
    return tensors


def _targets(target_modules: Any, refuse: Refuse) -> set[str]:
    """The modules (`MODULES`) the adapter may add to: target_modules' list (by the last part of each name), or all
    seven ("all-linear", a regex, none given)."""
    if not isinstance(target_modules, list):
        return set(MODULES)
    targets = {str(target).rsplit(".", 1)[-1] for target in target_modules}
    if unserved := sorted(targets - MODULES.keys()):
        raise refuse(f"targets {', '.join(unserved)}, which Sluice does not serve (only {', '.join(MODULES)})")
    return targets


def _config_decides(settings: Mapping[str, Any]) -> bool:
    """Whether adapter_config.json's `settings` alone say which modules of which layers the adapter adds to:
    target_modules "all-linear" or a list of module names ("q_proj"), perhaps with layers_to_transform. Not so for a
    regex, a list entry with a path ("model.layers.0.self_attn.q_proj", one layer's), exclude_modules or
    layers_pattern: the file's tensors then say it."""
    target_modules = settings.get("target_modules")
    names = target_modules == ALL_LINEAR or (
        isinstance(target_modules, list) and not any("." in str(target) for target in target_modules))
    return names and not settings.get("exclude_modules") and not settings.get("layers_pattern")


def _layers(layers_to_transform: Any, config: ModelConfig, refuse: Refuse) -> list[int]:
    """The layers the adapter transforms: layers_to_transform's (an index or a list), or all (as PEFT reads an empty
    list too)."""
    if layers_to_transform is None or layers_to_transform == []:
        return list(range(config.num_layers))
    layers = [layers_to_transform] if isinstance(layers_to_transform, int) else layers_to_transform
    if not isinstance(layers, list) or not all(
            isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < config.num_layers
            for layer in layers):
        raise refuse(f"has layers_to_transform {layers_to_transform!r}, not layer indices of the model's "
                     f"{config.num_layers} layers")
    return sorted(set(layers))


def _pairs(tensors: Mapping[str, np.ndarray], modules: set[str], layers: list[int], config_decides: bool,
           config: ModelConfig, refuse: Refuse) -> Pairs:
    """The file's `tensors` of `modules` on `layers`, and nothing else: every pair where `config_decides`
    (`_config_decides`), else those the file holds, each whole."""
    found = {key.removeprefix("base_model.model."): tensor for key, tensor in tensors.items()}
    served = {(module, layer): _keys(module, layer) for module in modules for layer in layers}
    present = served if config_decides else {
        pair: keys for pair, keys in served.items() if not found.keys().isdisjoint(keys)}
    if not present:
        raise refuse(f"adds to none of the modules Sluice serves ({', '.join(MODULES)})")
    if unserved := sorted(found.keys() - {key for keys in served.values() for key in keys}):
        more = f" and {len(unserved) - 1} more" if len(unserved) > 1 else ""
        raise refuse(f"holds {unserved[0]}{more}, which Sluice does not serve on this {config.num_layers}-layer model "
                     f"(it serves {', '.join(sorted(modules))} on layers {layers})")
    partner = {key: other for a, b in present.values() for key, other in ((a, b), (b, a))}
    if missing := sorted(partner.keys() - found.keys()):
        implied_by = "its adapter_config.json" if config_decides else partner[missing[0]]
        raise refuse(f"lacks {missing[0]}, which {implied_by} implies")
    return {pair: (found[a], found[b]) for pair, (a, b) in present.items()}


def _check_shapes(pairs: Pairs, rank: int, config: ModelConfig, refuse: Refuse) -> None:
    """Refuses the first tensor of `pairs` not in the shape the model and `rank` imply."""
    for module, layer in sorted(pairs):
        out_features, in_features = expected_shape(MODULES[module], config)
        for key, tensor, shape in zip(_keys(module, layer), pairs[module, layer],
                                      ([rank, in_features], [out_features, rank])):
            if list(tensor.shape) != shape:
                raise refuse(f"{key} has shape {list(tensor.shape)}, but the model and r {rank} imply {shape}")


def _keys(module: str, layer: int) -> tuple[str, str]:
    """The names of `module`'s lora_A and lora_B on `layer` in a PEFT file, without its "base_model.model." prefix."""
    prefix = f"model.layers.{layer}.{MODULE_PATHS[module]}"
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


def _stack(pairs: Pairs, rank: int, config: ModelConfig) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`LoraAdapter.a` and `.b` of the checked `pairs` (`_pairs`): zeros on the layers a module has none."""
    a, b = {}, {}
    for module in sorted({module for module, _ in pairs}):
        out_features, in_features = expected_shape(MODULES[module], config)
        a[module] = np.zeros((config.num_layers, in_features, rank), np.float32)
        b[module] = np.zeros((config.num_layers, rank, out_features), np.float32)
    for (module, layer), (lora_a_weight, lora_b_weight) in pairs.items():
        a[module][layer], b[module][layer] = lora_a_weight.T, lora_b_weight.T
    return a, b


def attach_adapters(model: Llama, adapters: Sequence[LoraAdapter], max_loras: int, max_rank: int,
                    sharding_rule: ShardingRule | None = None, every_projection: bool = False
                    ) -> list[dict[str, np.ndarray]]:
    """Gives `model` the LoRA parameters of `max_loras` slots (module docstring), adapter i in slot i for the first
    `max_loras` adapters (zeros in slots past them), each padded to rank `max_rank` (each read with it as
    `load_adapter`'s bound), in the model's activation dtype (quantized base weights or not), stored as its other
    layer parameters are (stacked, or one array per layer), for the projections the adapters add to, or with
    `every_projection` all of them (slots written later, `slot_weights`, may add to any). `sharding_rule` places each
    (tensor parallelism: `sharding.rules.param_sharding` with the model's mesh; default: the first device). Replaces
    what an earlier call attached. Returns every adapter's `slot_weights` for those projections, which a slot is
    given to run it. LoraError for a B times its scaling past the dtype's range."""
    projections = slot_projections(adapters, every_projection)
    weights = [slot_weights(adapter, model.config, max_rank, model.dtype, projections) for adapter in adapters]
    shapes = {name: (shape[0], max_loras, *shape[1:])
              for name, shape in _slot_shapes(model.config, max_rank, projections).items()}
    for name in LORA_PARAMS:
        if hasattr(model, name):
            delattr(model, name)
    # Committed to their devices, as the loader places the other weights: jit keys its programs by that too.
    shardings = (dict.fromkeys(shapes, jax.sharding.SingleDeviceSharding(jax.devices()[0])) if sharding_rule is None
                 else sharding_rule(model.config, shapes))
    for name, shape in shapes.items():
        stack = np.zeros(shape, model.dtype)
        for slot, slot_weight in enumerate(weights[:max_loras]):
            stack[:, slot] = slot_weight[name]
        model.set_layer_param(name, jax.device_put(stack, shardings[name]))
    return weights


def slot_projections(adapters: Sequence[LoraAdapter], every_projection: bool = False) -> list[str]:
    """The projections (`LORA_MODULES`' names) the slots of `adapters` hold LoRA parameters for: those some adapter
    adds to, or with `every_projection` all of them (`attach_adapters`)."""
    return [fused for fused, modules in LORA_MODULES.items()
            if every_projection or any(module in adapter.a for adapter in adapters for module in modules)]


def slot_weights(adapter: LoraAdapter, config: ModelConfig, max_rank: int, dtype: Any,
                 projections: Collection[str] = LORA_MODULES) -> dict[str, np.ndarray]:
    """One slot's LoRA parameters holding `adapter` (module docstring: its rank padded to `max_rank`, zeros for the
    modules it leaves out), in `dtype`, for `projections` (`LORA_MODULES`' names): each A `[L, K, P, R]`, each B
    `[L, R, out]`, for an adapter of a rank at most max_rank (`load_adapter`'s). LoraError for a B times its scaling
    past dtype's range."""
    weights = {name: np.zeros(shape, np.float32) for name, shape in _slot_shapes(config, max_rank, projections).items()}
    for fused in projections:
        for part, module in enumerate(LORA_MODULES[fused]):
            if module in adapter.a:
                weights[lora_a(fused)][:, :, part, :adapter.rank] = adapter.a[module]
                weights[lora_b(module)][:, :adapter.rank] = adapter.b[module] * adapter.scaling
    return {name: _cast(name, weight, dtype) for name, weight in weights.items()}


def _slot_shapes(config: ModelConfig, max_rank: int, projections: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The shape of one slot's part of each LoRA parameter of `projections`: A `[L, K, P, R]`, B `[L, R, out]`."""
    shapes = {}
    for fused in projections:
        modules = LORA_MODULES[fused]
        in_features = expected_shape(MODULES[modules[0]], config)[1]
        shapes[lora_a(fused)] = (config.num_layers, in_features, len(modules), max_rank)
        for module in modules:
            shapes[lora_b(module)] = (config.num_layers, max_rank, expected_shape(MODULES[module], config)[0])
    return shapes


def _cast(name: str, weight: np.ndarray, dtype: Any) -> np.ndarray:
    """LoRA parameter `name`'s `weight` in `dtype`; LoraError where that overflows it."""
    cast = weight.astype(dtype)
    if not np.isfinite(cast).all():  # B times the scaling past float16's range, say
        raise LoraError(f"LoRA {name} overflows {np.dtype(dtype).name} (an adapter's B times its scaling): serve it "
                        f"in a wider --dtype")
    return cast
