"""Small random Llama models written the way HF and llama.cpp store them (for loader and multi-process tests)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sluice.model.config import ModelConfig
from sluice.model.llama import Llama, split_qkv
from sluice.model.weights import GLOBAL_TENSORS, LAYER_TENSORS, TRANSPOSED


def unfuse_projections(params: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """The model's fused `wqkv`, `bqkv`, `w_gate_up` -> one tensor per projection (`LAYER_TENSORS` names)."""
    params = dict(params)
    for fused, names in (("wqkv", ("wq", "wk", "wv")), ("bqkv", ("bq", "bk", "bv"))):
        if fused in params:
            parts = split_qkv(params.pop(fused), config)
            params.update({n: np.asarray(p).reshape(*p.shape[:-2], -1) for n, p in zip(names, parts)})
    gate_up = params.pop("w_gate_up")
    params["w_gate"], params["w_up"] = gate_up[:, :, 0], gate_up[:, :, 1]
    return params


def random_hf_tensors(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Random weights keyed by HF tensor names, linears as [out, in] (the HF / GGUF numpy order)."""
    rng = np.random.default_rng(seed)
    model = Llama(config, rngs=nnx.Rngs(seed))
    params = unfuse_projections({path[0]: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}, config)
    tensors = {}
    for name, (_, hf_suffix) in LAYER_TENSORS.items():
        if name in params:
            value = params[name]
            if name.endswith("norm"):
                value = rng.uniform(0.5, 1.5, value.shape).astype(np.float32)
            for layer in range(config.num_layers):
                tensors[f"model.layers.{layer}.{hf_suffix}"] = value[layer].T if name in TRANSPOSED else value[layer]
    for name, (_, hf_name) in GLOBAL_TENSORS.items():
        if name in params:
            value = params[name]
            tensors[hf_name] = value.T if name in TRANSPOSED else value
    return {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}


def train_tokenizer(vocab_size: int) -> HFTokenizer:
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    return tokenizer


# A ChatML-like template in the tokenizer's own special tokens.
CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def write_hf_folder(folder: Path, config: ModelConfig, seed: int, num_files: int = 1,
                    chat_template: str | None = None) -> dict[str, np.ndarray]:
    """Writes config.json, tokenizer files (with `chat_template`, if given) and random weights split over
    `num_files` safetensors; returns them.

    The tokenizer has `<s>` = 1 (BOS, added) and `</s>` = 2 (EOS).
    """
    folder.mkdir(parents=True, exist_ok=True)
    tensors = random_hf_tensors(config, seed)
    names = sorted(tensors)
    for i in range(num_files):
        part = names[i * len(names) // num_files:(i + 1) * len(names) // num_files]
        save_file({k: tensors[k] for k in part}, str(folder / f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "bos_token_id": 1, "eos_token_id": 2,
    }))
    train_tokenizer(config.vocab_size).save(str(folder / "tokenizer.json"))
    template = {} if chat_template is None else {"chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, **template})
    )
    return tensors
