"""Loading weights from GGUF files and HF safetensors folders into Sluice's stacked parameter layout.

Both readers return the model's config and a function that reads `{name: float32 ndarray}` with the names and
shapes of `model.llama.Llama`: linear weights `[num_layers, in_features, out_features...]` (q/k/v and gate/up fused
as the model lays them out), norms `[num_layers, hidden]` (a Qwen3's q/k norms `[num_layers, head_dim]`),
`embed [vocab, hidden]`. They check the file's index of tensors against the config first, so a file that does not
make the model is refused before a weight is read. `LAYER_TENSORS` names the tensors as the files hold them, one per
projection.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from tqdm import tqdm

from sluice.model.config import ModelConfig
from sluice.model.llama import fuse_qkv

Params = dict[str, np.ndarray]

# File-level name -> (GGUF tensor suffix, HF tensor suffix); per-layer names are stacked over layers.
LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
GLOBAL_TENSORS = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "final_norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}
TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"}


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of Q/K rows (interleaved RoPE pairs -> HF's rotate-half halves).

    weight: [num_heads * head_dim, ...] in GGUF row order -> the same shape in HF row order.
    """
    head_dim = weight.shape[0] // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


BIASES = {"bq", "bk", "bv"}
QK_NORMS = {"q_norm", "k_norm"}
# Tensors some files hold that are no weights: the rotary frequencies of HF's older Llamas (which their config
# implies) and the factors of llama.cpp's Llama 3.1 files (which `read_gguf` reads into the config).
ROPE_FREQS = "rope_freqs.weight"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ROPE_FREQS)


def _file_name(name: str, layer: int | None, column: int, layer_prefix: str) -> str:
    """The name a file gives `name` (`LAYER_TENSORS` / `GLOBAL_TENSORS`) of `layer` (None for a global tensor):
    `column` 0 for GGUF's with `layer_prefix` "blk.{}.", 1 for HF's with "model.layers.{}."."""
    if layer is None:
        return GLOBAL_TENSORS[name][column]
    return layer_prefix.format(layer) + LAYER_TENSORS[name][column]


def expected_shape(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The shape of one tensor `name` as the files hold it (HF orientation: `[out, in]` for linears) for `config`."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    return {
        "embed": (vocab, hidden), "lm_head": (vocab, hidden), "final_norm": (hidden,), "attn_norm": (hidden,),
        "mlp_norm": (hidden,), "wq": (q, hidden), "wk": (kv, hidden), "wv": (kv, hidden), "bq": (q,), "bk": (kv,),
        "bv": (kv,), "q_norm": (config.head_dim,), "k_norm": (config.head_dim,), "wo": (hidden, q),
        "w_gate": (inner, hidden), "w_up": (inner, hidden), "w_down": (hidden, inner),
    }[name]


def _used(name: str, config: ModelConfig) -> bool:
    """Whether `config`'s model has tensor `name` (`LAYER_TENSORS` / `GLOBAL_TENSORS`): q/k/v biases and q/k norms
    only where it says so."""
    return (name not in BIASES or config.attention_bias) and (name not in QK_NORMS or config.qk_norm)


def _plan(config: ModelConfig, names: Callable[[str, int | None], str], shapes: Mapping[str, tuple[int, ...]]
          ) -> dict[str, list[str]]:
    """The file's names of each tensor of `config`'s model that is read (by `LAYER_TENSORS` / `GLOBAL_TENSORS`
    name; one a layer for layer tensors): `names(name, layer)` is the file's name of each (layer None for global
    tensors), `shapes` the shape of each tensor the file holds (HF orientation: `[out, in]` for linears).

    ValueError naming the first tensor the file lacks, or holds in another shape than the config implies, or the
    tensors it holds that the model would not use (another architecture's, or layers past the config's count).
    A tied model's LM head is the embedding: the file's, if any, is not read."""
    wanted = [n for n in (*GLOBAL_TENSORS, *LAYER_TENSORS) if _used(n, config)]
    plan: dict[str, list[str]] = {}
    used = set()
    for name in wanted:
        keys = [names(name, layer) for layer in ([None] if name in GLOBAL_TENSORS else range(config.num_layers))]
        used.update(keys)
        if name == "lm_head" and config.tie_word_embeddings:
            continue
        if missing := [key for key in keys if key not in shapes]:
            raise ValueError(f"the file lacks tensor {missing[0]}")
        if wrong := [key for key in keys if shapes[key] != expected_shape(name, config)]:
            raise ValueError(f"tensor {wrong[0]} has shape {shapes[wrong[0]]}, but the config implies "
                             f"{expected_shape(name, config)}")
        plan[name] = keys
    unused = sorted(key for key in shapes if key not in used and not key.endswith(IGNORED_SUFFIXES))
    if unused:
        raise ValueError(f"the file holds {len(unused)} tensors a {config.num_layers}-layer Llama-family model does "
                         f"not use ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''})")
    return plan


def _read(config: ModelConfig, plan: dict[str, list[str]], read: Callable[[str, str], np.ndarray],
          progress: str) -> Params:
    """The tensors `plan` (`_plan`) names, read by `read(name, file_name)` in HF orientation, stacked over layers
    and transposed into the model's fused layout; a bar named `progress` counts them."""
    params: Params = {}
    with tqdm(total=sum(map(len, plan.values())), desc=progress, unit="tensor", leave=False) as bar:
        for name, keys in plan.items():
            tensors = []
            for key in keys:
                tensor = read(name, key)
                tensors.append(tensor.T if name in TRANSPOSED else tensor)
                bar.update()
            params[name] = tensors[0] if name in GLOBAL_TENSORS else np.stack(tensors)
    return fuse_projections(params, config)


def fuse_projections(params: Params, config: ModelConfig) -> Params:
    """One tensor per projection (`LAYER_TENSORS` names) -> the model's fused `wqkv`, `bqkv`, `w_gate_up`."""
    params = dict(params)
    params["wqkv"] = fuse_qkv(params.pop("wq"), params.pop("wk"), params.pop("wv"), config)
    if "bq" in params:
        params["bqkv"] = fuse_qkv(params.pop("bq"), params.pop("bk"), params.pop("bv"), config)
    params["w_gate_up"] = np.stack([params.pop("w_gate"), params.pop("w_up")], axis=2)
    return params


def open_gguf(path: Path) -> Any:
    """gguf's reader of the file at `path`; ValueError if it is cut short or corrupt, or holds what the installed
    gguf does not know (a tensor type llama.cpp added since): the reader itself raises whatever it trips on
    (IndexError for a file of little more than its magic, ValueError elsewhere)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as error:
        raise ValueError(f"not a whole GGUF file (cut short or corrupt), or one newer than gguf "
                         f"{importlib.metadata.version('gguf')} reads: {type(error).__name__}: {error}") from None


def _check_whole(path: Path, fields: Mapping[str, Any]) -> None:
    """ValueError for one part of a model llama.cpp's gguf-split wrote in several files (its metadata in the first)."""
    parts = fields.get("split.count", 1)
    if parts > 1:
        raise ValueError(f"{path.name} is part {fields.get('split.no', 0) + 1} of a GGUF split into {parts} files: "
                         f"merge them into one (llama.cpp's llama-gguf-split --merge), which Sluice reads")


@functools.cache
def _dequantizes(tensor_type: Any) -> bool:
    """Whether gguf dequantizes `tensor_type` (a GGMLQuantizationType); it tells only when asked, so one block of
    zeros is asked."""
    import gguf

    try:
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[tensor_type][1], np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _check_types(tensors: Mapping[str, Any]) -> None:
    """ValueError naming the first of the GGUF `tensors` (gguf's ReaderTensor by name) whose type Sluice cannot
    dequantize (an integer type, float64)."""
    if unread := [name for name, tensor in tensors.items() if not _dequantizes(tensor.tensor_type)]:
        raise ValueError(f"tensor {unread[0]} is of type {tensors[unread[0]].tensor_type.name}, which Sluice does not "
                         f"read")


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, Any], Callable[[], Params]]:
    """A Llama-family GGUF file's config, its metadata fields (for the tokenizer), and the function that reads its
    float32 params; ValueError if it is one part of a split model, holds a tensor of a type Sluice does not read,
    or its tensors do not make the config's model (`_plan`)."""
    import gguf

    reader = open_gguf(path)
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    _check_whole(path, fields)
    tensors = {t.name: t for t in reader.tensors}
    _check_types(tensors)
    factors = tensors.get(ROPE_FREQS)
    config = ModelConfig.from_gguf_fields(
        fields, tied_embeddings="output.weight" not in tensors,
        rope_freq_factors=None if factors is None else tuple(
            gguf.quants.dequantize(factors.data, factors.tensor_type).astype(float).ravel()),
    )
    # llama.cpp's converter interleaves Q/K rows for its llama arch and those it converts as one (Granite); its
    # Qwens keep HF's rotate-half order (NEOX RoPE in llama.cpp)
    permute_rope = fields["general.architecture"] in ("llama", "mistral", "granite")

    def read(name: str, gguf_name: str) -> np.ndarray:
        tensor = tensors[gguf_name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if permute_rope and name in ("wq", "bq"):
            array = unpermute_rope_rows(array, config.num_heads)
        elif permute_rope and name in ("wk", "bk"):
            array = unpermute_rope_rows(array, config.num_kv_heads)
        return array

    shapes = {name: tuple(int(d) for d in reversed(tensor.shape)) for name, tensor in tensors.items()}
    plan = _plan(config, lambda name, layer: _file_name(name, layer, 0, "blk.{}."), shapes)
    return config, fields, lambda: _read(config, plan, read, "dequantize")


INDEX_FILE = "model.safetensors.index.json"


def _weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: those its index names, if it has one, as vLLM reads them (Mistral's folders
    also hold consolidated.safetensors, the same weights in Mistral's own names, which the index leaves out)."""
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / INDEX_FILE).is_file():
        return files
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        named = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{INDEX_FILE} does not read as an index of weights ({type(error).__name__}: {error})") \
            from None
    if missing := sorted(named - {file.name for file in files}):
        others = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{INDEX_FILE} names {missing[0]}{others}, which the folder lacks")
    return [file for file in files if file.name in named]


def read_safetensors_folder(folder: Path, hf_config: dict[str, Any]) -> tuple[ModelConfig, Callable[[], Params]]:
    """An HF model folder's config (from `hf_config`, its config.json) and the function that reads its float32
    params from its `*.safetensors`; ValueError if its tensors do not make the config's model (`_plan`)."""
    from safetensors import SafetensorError, safe_open

    config = ModelConfig.from_hf(hf_config)
    files = _weight_files(folder)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    handles = []
    for file in files:
        try:
            handles.append(safe_open(str(file), framework="flax"))  # flax reads bfloat16, which plain numpy cannot
        except SafetensorError as error:
            raise ValueError(f"{file.name} does not read as safetensors (cut short or corrupt): {error}") from None
    index = {key: h for h in handles for key in h.keys()}

    def read(name: str, hf_name: str) -> np.ndarray:
        return np.asarray(index[hf_name].get_tensor(hf_name), dtype=np.float32)

    shapes = {key: tuple(handle.get_slice(key).get_shape()) for key, handle in index.items()}
    plan = _plan(config, lambda name, layer: _file_name(name, layer, 1, "model.layers.{}."), shapes)
    return config, lambda: _read(config, plan, read, "read safetensors")
