"""Loading weights from GGUF files and HF safetensors folders into Sluice's stacked parameter layout.

Both loaders return `(ModelConfig, {name: float32 ndarray})` with the names and shapes of `model.llama.Llama`:
linear weights `[num_layers, in_features, out_features...]` (q/k/v and gate/up fused as the model lays them out),
norms `[num_layers, hidden]`, `embed [vocab, hidden]`. `LAYER_TENSORS` names the tensors as the files hold them,
one per projection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

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


def _collect(config: ModelConfig, read: Callable[[str, int | None], np.ndarray | None]) -> Params:
    """Gathers every known tensor through `read(name, layer)` (layer None for global tensors), which returns
    it in HF orientation (`[out, in]` for linears) or None when the file lacks it; stacks and transposes."""
    params: Params = {}
    for name in GLOBAL_TENSORS:
        tensor = read(name, None)
        if tensor is not None:
            params[name] = tensor.T if name in TRANSPOSED else tensor
    for name in LAYER_TENSORS:
        layers = [read(name, i) for i in range(config.num_layers)]
        if all(t is not None for t in layers):
            params[name] = np.stack([t.T if name in TRANSPOSED else t for t in layers])
    return fuse_projections(params, config)


def fuse_projections(params: Params, config: ModelConfig) -> Params:
    """One tensor per projection (`LAYER_TENSORS` names) -> the model's fused `wqkv`, `bqkv`, `w_gate_up`."""
    params = dict(params)
    params["wqkv"] = fuse_qkv(params.pop("wq"), params.pop("wk"), params.pop("wv"), config)
    if "bq" in params:
        params["bqkv"] = fuse_qkv(params.pop("bq"), params.pop("bk"), params.pop("bv"), config)
    params["w_gate_up"] = np.stack([params.pop("w_gate"), params.pop("w_up")], axis=2)
    return params


def load_gguf(path: Path) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Reads a Llama-family GGUF file: (config, float32 params, metadata fields for the tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    config = ModelConfig.from_gguf_fields(fields, tied_embeddings="output.weight" not in tensors)
    permute_rope = fields["general.architecture"] in ("llama", "mistral")
    bar = tqdm(total=len(tensors), desc="dequantize", unit="tensor", leave=False)

    def read(name: str, layer: int | None) -> np.ndarray | None:
        gguf_name = GLOBAL_TENSORS[name][0] if layer is None else f"blk.{layer}.{LAYER_TENSORS[name][0]}"
        tensor = tensors.get(gguf_name)
        if tensor is None:
            return None
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if permute_rope and name in ("wq", "bq"):
            array = unpermute_rope_rows(array, config.num_heads)
        elif permute_rope and name in ("wk", "bk"):
            array = unpermute_rope_rows(array, config.num_kv_heads)
        bar.update()
        return array

    params = _collect(config, read)
    bar.close()
    return config, params, fields


def load_safetensors_folder(folder: Path) -> tuple[ModelConfig, Params]:
    """Reads an HF model folder (`config.json` + `*.safetensors`) into (config, float32 params)."""
    from safetensors import safe_open

    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    # The flax framework reads bfloat16, which plain numpy cannot.
    handles = [safe_open(str(file), framework="flax") for file in files]
    index = {key: h for h in handles for key in h.keys()}
    bar = tqdm(total=len(index), desc="read safetensors", unit="tensor", leave=False)

    def read(name: str, layer: int | None) -> np.ndarray | None:
        hf_name = GLOBAL_TENSORS[name][1] if layer is None else f"model.layers.{layer}.{LAYER_TENSORS[name][1]}"
        if hf_name not in index:
            return None
        bar.update()
        return np.asarray(index[hf_name].get_tensor(hf_name), dtype=np.float32)

    params = _collect(config, read)
    bar.close()
    if config.tie_word_embeddings:
        params.pop("lm_head", None)
    return config, params
