"""One dataclass for Llama-family model configs (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, Granite 3), read from GGUF
or HF config.json;
and the reader of an HF folder's JSON files (config.json, tokenizer_config.json, generation_config.json)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "GraniteForCausalLM")
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "granite")
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "num_key_value_heads": 8,
                "sliding_window": 4096},
    "qwen2": {"attention_bias": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "num_key_value_heads": 32, "use_sliding_window": False},
    "qwen3": {"head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_key_value_heads": 32,
              "use_sliding_window": False},
    "granite": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
}
"""What transformers assumes of a key a model type's config.json leaves out, where Sluice reads it and the default
is not the plain one in `ModelConfig.from_hf` (Qwen2's q/k/v biases have no key; the Qwens write a `sliding_window`
they use only with `use_sliding_window`; a null `num_key_value_heads` is `num_attention_heads`)."""
GRANITE_SCALARS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                   "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
"""Granite's config.json keys (`ModelConfig`'s fields of the same names) -> the GGUF keys llama.cpp's converter writes
them as (after the architecture)."""

logger = logging.getLogger(__name__)


def read_json_object(path: Path, *, missing_ok: bool) -> dict[str, Any]:
    """The JSON object in the file at `path`; {} for no such file where `missing_ok`. ValueError in one line naming
    the file if it is missing (and not `missing_ok`), is not JSON, or holds another JSON value than an object."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise ValueError(f"{path.parent} has no {path.name}") from None
    try:
        found = json.loads(text)  # bytes: UTF-8/16/32 as JSON allows; other bytes are a UnicodeDecodeError here
    except ValueError as error:
        raise ValueError(f"{path.name} is not JSON: {error}") from None
    if not isinstance(found, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(found), "a number")
        raise ValueError(f"{path.name} holds {kind}, not a JSON object")
    return found


ROPE_SCALINGS = ("llama3", "linear", "yarn")
"""The RoPE scalings Sluice implements (`RopeScaling.kind`)."""
HF_SCALING_KEYS = {
    "linear": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}
"""The keys of config.json's linear and YaRN scalings Sluice reads, beside the type and rope_theta: those
transformers' `_compute_linear_scaling_rope_parameters` and `_compute_yarn_parameters` read."""


def _check_rope_scaling(kind: Any, factor: Any, where: str) -> None:
    """ValueError for a RoPE scaling Sluice does not implement that changes anything: dynamic NTK by a factor other
    than 1, LongRoPE or a kind Sluice does not know by any factor (LongRoPE's short factors divide the frequencies
    at every length). Served without it, the model would not be the one trained (beyond its original context, or at
    all)."""
    if kind in (None, "none", "default", *ROPE_SCALINGS) or (kind == "dynamic" and factor in (None, 1.0)):
        return
    given = "" if factor is None else f" (factor {factor})"
    raise ValueError(f"{where} asks for RoPE scaling of type {kind!r}{given}, which Sluice does not implement "
                     f"(only {', '.join(ROPE_SCALINGS)})")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale for a context `factor` times the original (transformers' and llama.cpp's
    `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _gguf_rope_scaling(get: Callable[..., Any], arch: str, context: int) -> RopeScaling | None:
    """The scaling GGUF metadata (`get(key without the architecture)`) gives, read as llama.cpp reads it for its
    Llama and Qwen graphs: linear where no type is named, by `rope.scaling.factor` or the older `rope.scale_linear`
    (none without a factor, or at 0); YaRN as `_gguf_yarn` reads it. ValueError for a scaling Sluice does not
    implement (`_check_rope_scaling`, `_refuse_unimplemented_gguf_keys`)."""
    kind = get("rope.scaling.type", "llama3" if get("rope.scaling.low_freq_factor") is not None else "linear")
    factor = get("rope.scaling.factor") or get("rope.scale_linear")
    _check_rope_scaling(kind, factor, "the GGUF metadata")
    _refuse_unimplemented_gguf_keys(get, arch, kind)
    if kind == "llama3":
        return RopeScaling(
            factor=float(get("rope.scaling.factor", 8.0)),
            low_freq_factor=float(get("rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(get("rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length", 8192)),
        )
    if kind == "yarn":
        return _gguf_yarn(get, float(factor or 1.0), context)
    return RopeScaling(float(factor), kind="linear") if kind == "linear" and factor else None


def _refuse_unimplemented_gguf_keys(get: Callable[..., Any], arch: str, kind: str) -> None:
    """ValueError for GGUF metadata that changes a RoPE scaling of `kind` in a way Sluice does not implement:
    `rope.scaling.yarn_log_multiplier` and `rope.scaling.yarn_ext_factor` (llama.cpp applies them in other graphs
    than the Llama and Qwen ones), and `rope.scaling.attn_factor` to another scaling than YaRN."""
    neutral = {"rope.scaling.yarn_log_multiplier": 0.0, "rope.scaling.yarn_ext_factor": 1.0}
    if kind != "yarn":
        neutral["rope.scaling.attn_factor"] = 1.0
    for key, value in neutral.items():
        if get(key, value) != value:
            raise ValueError(f"the GGUF metadata's {arch}.{key} is {get(key)}, which Sluice does not implement with "
                             f"RoPE scaling of type {kind!r}")


def _gguf_yarn(get: Callable[..., Any], factor: float, context: int) -> RopeScaling:
    """GGUF metadata's YaRN by `factor` over `rope.scaling.original_context_length` (default the model's `context`),
    its cos and sin scaled by `rope.scaling.attn_factor` as llama.cpp scales them. The keys llama.cpp's converter
    copies from config.json (`yarn_beta_fast`, `yarn_beta_slow`, `yarn_attn_factor`: beta_fast, beta_slow,
    attention_factor), which llama.cpp's Llama and Qwen graphs leave unread, mean what they meant there."""
    given = get("rope.scaling.yarn_attn_factor")
    attention = yarn_mscale(factor) if given is None else float(given)
    return RopeScaling(
        factor, original_max_position_embeddings=int(get("rope.scaling.original_context_length", context)),
        kind="yarn", beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
        attention_factor=attention * float(get("rope.scaling.attn_factor", 1.0)))


def _hf_rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """config.json's RoPE theta and scaling, from transformers 5's `rope_parameters` or 4's `rope_theta` and
    `rope_scaling`; ValueError for a scaling that is no object, or that Sluice does not implement
    (`_check_rope_scaling`, `_hf_scaling`), or for both keys (a scaling added as transformers 4 wrote it beside
    what transformers 5 wrote, which transformers reads without rope_parameters' theta)."""
    if config.get("rope_parameters") and config.get("rope_scaling"):
        raise ValueError("config.json has both rope_parameters and rope_scaling: write the scaling into "
                         "rope_parameters")
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    raw = config.get(key) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config.json's {key} must be an object, got {raw!r:.80}")
    if per_layer := [name for name, value in raw.items() if isinstance(value, dict)]:
        raise ValueError(f"config.json's {key} holds one per layer type ({', '.join(per_layer)}), which Sluice does "
                         f"not implement")
    kind = raw.get("rope_type", raw.get("type"))
    _check_rope_scaling(kind, raw.get("factor"), "config.json")
    partial = raw.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json's partial_rotary_factor of {partial!r} rotates only part of each head, which "
                         f"Sluice does not implement")
    theta = float(raw.get("rope_theta", config.get("rope_theta", 10000.0)))
    if kind in HF_SCALING_KEYS:
        return theta, _hf_scaling(kind, raw, config, key)
    if kind != "llama3":
        return theta, None
    try:
        return theta, RopeScaling(
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    except KeyError as error:
        raise ValueError(f"config.json's {key} of type 'llama3' lacks {error.args[0]}") from None


def _hf_scaling(kind: str, raw: dict[str, Any], config: dict[str, Any], key: str) -> RopeScaling:
    """config.json's linear or YaRN scaling `raw` (under `key`), as transformers computes it (`_hf_yarn`).
    ValueError for a key Sluice does not read or a factor that is missing or no positive number."""
    # partial_rotary_factor: refused by `_hf_rope` unless 1 (transformers 5 saves a top-level one in here).
    unread = raw.keys() - HF_SCALING_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if unread:
        raise ValueError(f"config.json's {key} of type {kind!r} has {', '.join(sorted(unread))}, which Sluice does "
                         f"not implement")
    factor = raw.get("factor")
    if factor is None:
        raise ValueError(f"config.json's {key} of type {kind!r} lacks factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"config.json's {key}' factor must be a positive number, got {factor!r}")
    if kind == "linear":
        return RopeScaling(float(factor), kind="linear")
    return _hf_yarn(raw, config, key, float(factor))


def _hf_yarn(raw: dict[str, Any], config: dict[str, Any], key: str, factor: float) -> RopeScaling:
    """config.json's YaRN by `factor`, as transformers' `_compute_yarn_parameters` reads it: betas 32 and 1 where
    unset, the correction range truncated unless `truncate` is false; the original context that of a top-level
    original_max_position_embeddings (as Phi-3 writes it, which transformers prefers), else the scaling's own, else
    the model's; the attention factor given, or else made of mscale and mscale_all_dim where both are set, or else
    `yarn_mscale(factor)`."""
    if config.get("original_max_position_embeddings") is not None:
        original = _size(config, "original_max_position_embeddings", "config.json")
    else:
        original = _size(raw, "original_max_position_embeddings", f"config.json's {key}",
                         config.get("max_position_embeddings"))
    mscale, mscale_all_dim = raw.get("mscale"), raw.get("mscale_all_dim")
    if raw.get("attention_factor") is not None:
        attention = float(raw["attention_factor"])
    elif mscale and mscale_all_dim:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention = yarn_mscale(factor)
    return RopeScaling(factor, original_max_position_embeddings=original, kind="yarn",
                       beta_fast=float(raw.get("beta_fast") or 32.0), beta_slow=float(raw.get("beta_slow") or 1.0),
                       truncate=bool(raw.get("truncate", True)), attention_factor=attention)


def _served_context(context: int, scaling: RopeScaling | None) -> int:
    """The context a model of `context` positions is served with under `scaling`, as vLLM derives it
    (`_get_and_verify_max_len`, vllm/config/model.py): a scaling other than Llama 3's multiplies it by its factor,
    YaRN's from its original context; Llama 3's context is already the scaled one."""
    if scaling is None or scaling.kind == "llama3":
        return context
    base = scaling.original_max_position_embeddings if scaling.kind == "yarn" else context
    return int(base * scaling.factor)


def _size(fields: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    """`fields[key]` (`default` if absent or null), a positive integer; ValueError naming `key` in `source`."""
    value = default if fields.get(key) is None else fields[key]
    if value is None:
        raise ValueError(f"{source} lacks {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}'s {key} must be a positive integer, got {value!r}")
    return value


def _scalar(fields: dict[str, Any], key: str, source: str, default: float) -> float:
    """`fields[key]` (`default` if absent or null), a positive number, as a float; ValueError naming `key` in
    `source`."""
    value = default if fields.get(key) is None else fields[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{source}'s {key} must be a positive number, got {value!r}")
    return float(value)


def _hf_granite_scalars(config: dict[str, Any]) -> dict[str, float]:
    """config.json's Granite scalars (`GRANITE_SCALARS`), each 1 where absent, as GraniteConfig defaults them (its
    attention_multiplier too, where a Llama's softmax scale would be head_dim**-0.5)."""
    return {key: _scalar(config, key, "config.json", 1.0) for key in GRANITE_SCALARS}


def _gguf_granite_scalars(fields: dict[str, Any], arch: str) -> dict[str, float]:
    """The Granite scalars GGUF metadata gives (`GRANITE_SCALARS`), as llama.cpp's granite graph reads them: the
    logit scale required (ValueError without it: served unscaled, the logits would be 8-16x too sharp); the others
    left out where absent or 0, which llama.cpp's own saver writes for "not set" (1, and head_dim**-0.5 for the
    softmax scale)."""
    if fields.get(f"{arch}.logit_scale") is None:
        raise ValueError(f"the GGUF metadata lacks {arch}.logit_scale, which llama.cpp requires of a Granite")
    return {field: _scalar(fields, f"{arch}.{key}", "the GGUF metadata", 1.0)
            for field, key in GRANITE_SCALARS.items() if fields.get(f"{arch}.{key}") not in (None, 0)}


def _hf_context(config: dict[str, Any], scaling: RopeScaling | None) -> int:
    """config.json's context length under its RoPE `scaling` (`_served_context`), capped at its `sliding_window`
    where that is shorter, with a warning: Sluice's attention is full causal, which is sliding-window attention only
    while a sequence fits the window (vLLM caps the length so where its attention has no sliding window). ValueError
    for a window not a positive integer."""
    context = _served_context(_size(config, "max_position_embeddings", "config.json"), scaling)
    if not config.get("use_sliding_window", True) or config.get("sliding_window") is None:
        return context
    window = _size(config, "sliding_window", "config.json")
    if window < context:
        logger.warning("config.json's sliding_window of %d tokens is shorter than its context of %d: Sluice's "
                       "attention is full causal, the same only within the window, so the model's context is capped "
                       "at %d tokens", window, context, window)
    return min(window, context)


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling of `kind` (`ROPE_SCALINGS`, as config.json names it) with the parameters that kind
    reads, the others None: Llama 3's ("llama3", the kind of a scaling saved before scalings had one) its factor,
    low and high frequency factors and original context; "linear" its factor alone; "yarn" its factor, original
    context, betas, whether its correction range is truncated, and `attention_factor`, by which cos and sin are
    scaled (q.k by its square)."""

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    kind: str = "llama3"
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Each rotary frequency's divisor, as a GGUF file's rope_freqs.weight gives them (llama.cpp's converter keeps
    # Llama 3.1's scaling so, and no key of it): [head_dim // 2]; they stand for `rope_scaling`.
    rope_freq_factors: tuple[float, ...] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Qwen3: each head's q and k RMS-normalized (weights [head_dim], eps `rms_norm_eps`) between projection and RoPE.
    qk_norm: bool = False
    # The longest sequence served: the model's context, capped at its sliding window (`_hf_context`).
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Granite's scalars, which change nothing at these defaults: the token embeddings are multiplied by
    # `embedding_multiplier`, each attention and MLP output by `residual_multiplier` before its residual add, and the
    # logits divided by `logits_scaling`; `attention_multiplier` is the softmax scale (`softmax_scale`).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        """What q.k is multiplied by before the softmax: `attention_multiplier`, else head_dim**-0.5."""
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A 2-layer random-weight config for fast tests (GQA ratio 2, tied embeddings off)."""
        fields = dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,),
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], *, tied_embeddings: bool,
                         rope_freq_factors: tuple[float, ...] | None = None) -> ModelConfig:
        """Build from GGUF key/value metadata (`{"llama.block_count": 30, ...}`, values already decoded).

        GGUF has no tied-embeddings flag: a file without `output.weight` ties the LM head to the embedding.
        `rope_freq_factors`: the file's `rope_freqs.weight`, if it has one.
        """
        arch = fields.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r} (Llama-family only: "
                             f"{', '.join(GGUF_ARCHITECTURES)})")

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{arch}.{key}", default)

        def size(key: str, default: int | None = None) -> int:
            return _size(fields, f"{arch}.{key}", "the GGUF metadata", default)

        if get("expert_count"):  # llama.cpp writes Mixtral as a llama with experts
            raise ValueError(f"the GGUF metadata's {arch}.expert_count of {get('expert_count')} makes the model a "
                             f"mixture of experts, which Sluice does not serve")
        hidden = size("embedding_length")
        num_heads = size("attention.head_count")
        head_dim = size("attention.key_length", hidden // num_heads)
        if rope_freq_factors is not None and len(rope_freq_factors) != head_dim // 2:
            raise ValueError(f"tensor rope_freqs.weight has shape ({len(rope_freq_factors)},), but the config implies "
                             f"({head_dim // 2},)")
        if size("rope.dimension_count", head_dim) != head_dim:
            raise ValueError(f"the GGUF metadata's {arch}.rope.dimension_count of {get('rope.dimension_count')} "
                             f"rotates only part of each head of {head_dim}, which Sluice does not implement")
        context = size("context_length", 4096)
        scaling = _gguf_rope_scaling(get, arch, context)
        if rope_freq_factors is not None and scaling is not None and scaling.kind != "llama3":
            raise ValueError(f"the GGUF file's rope_freqs.weight with RoPE scaling of type {scaling.kind!r}, which "
                             f"Sluice does not implement")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=size("vocab_size", len(fields.get("tokenizer.ggml.tokens") or []) or None),
            hidden_size=hidden,
            intermediate_size=size("feed_forward_length"),
            num_layers=size("block_count"),
            num_heads=num_heads,
            num_kv_heads=size("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=tied_embeddings,
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            max_position_embeddings=_served_context(context, scaling),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **(_gguf_granite_scalars(fields, arch) if arch == "granite" else {}),
        )

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (`HF_ARCHITECTURES`), as transformers 4 (`rope_theta`,
        `rope_scaling`) or 5 (both in `rope_parameters`) writes it; ValueError for another architecture, or a size
        missing or not a positive integer."""
        if not isinstance(config, dict):
            raise ValueError(f"config.json holds a {type(config).__name__}, not an object")
        architectures = config.get("architectures") or []
        model_type = config.get("model_type", "llama")
        if model_type not in HF_MODEL_TYPES or any(a not in HF_ARCHITECTURES for a in architectures):
            raise ValueError(f"unsupported architecture {', '.join(architectures) or model_type} (Llama-family only: "
                             f"{', '.join(HF_ARCHITECTURES)})")
        config = {**HF_DEFAULTS[model_type], **config}

        def size(key: str, default: int | None = None) -> int:
            return _size(config, key, "config.json", default)

        hidden = size("hidden_size")
        num_heads = size("num_attention_heads")
        rope_theta, scaling = _hf_rope(config)
        eos = config.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=size("num_key_value_heads", num_heads),
            head_dim=size("head_dim", hidden // num_heads),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(config["rms_norm_eps"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=_hf_context(config, scaling),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **(_hf_granite_scalars(config) if model_type == "granite" else {}),
        )

    @property
    def rope_attention_factor(self) -> float:
        """What cos and sin are scaled by (YaRN's attention factor; 1 for the other scalings)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.attention_factor

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse rotary frequencies `[head_dim // 2]` float64, scaled as `rope_scaling` says (by
        `rope_freq_factors` where given, as llama.cpp applies Llama 3's)."""
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.rope_freq_factors is not None:
            return inv_freq / np.asarray(self.rope_freq_factors, np.float64)
        s = self.rope_scaling
        if s is None:
            return inv_freq
        if s.kind == "linear":
            return inv_freq / s.factor
        if s.kind == "yarn":
            return yarn_inv_freq(inv_freq, s, self.rope_theta)
        return llama3_inv_freq(inv_freq, s)


def llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3's scaling of `inv_freq` [head_dim // 2] float64: the frequencies whose wavelength is longer than the
    original context over `low_freq_factor` divided by the factor, those shorter than it over `high_freq_factor`
    kept, and those between blended smoothly."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)


def yarn_inv_freq(inv_freq: np.ndarray, s: RopeScaling, theta: float) -> np.ndarray:
    """YaRN's scaling of `inv_freq` [head_dim // 2] float64 (RoPE base `theta`), as transformers'
    `_compute_yarn_parameters` blends it: the frequencies that turn more than `beta_fast` times over the original
    context kept, those that turn fewer than `beta_slow` times divided by the factor, and a linear ramp over the
    frequency index between."""
    head_dim = 2 * len(inv_freq)

    def correction_dim(rotations: float) -> float:
        """The (fractional) frequency index that turns `rotations` times over the original context."""
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(len(inv_freq)) - low) / (high - low if high != low else 0.001), 0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)
