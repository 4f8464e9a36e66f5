"""Small random Llama models written the way HF and llama.cpp store them (for loader and multi-process tests)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import AddedToken
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


def train_tokenizer_with_special_tokens(*tokens: str, vocab_size: int = 288) -> HFTokenizer:
    """`train_tokenizer`'s vocabulary with `tokens` added after it as special tokens (as tool-call markers are in
    Mistral's and Granite's vocabularies), `vocab_size` ids in all."""
    tokenizer = train_tokenizer(vocab_size - len(tokens))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokens])
    return tokenizer


# A ChatML-like template in the tokenizer's own special tokens.
CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def write_tokenizer_files(folder: Path, vocab_size: int, chat_template: str | None = None) -> None:
    """Writes tokenizer.json (`train_tokenizer`'s: `<s>` = 1, BOS, added; `</s>` = 2, EOS) and tokenizer_config.json
    (with `chat_template`, if given) into `folder`."""
    train_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    template = {} if chat_template is None else {"chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, **template})
    )


def write_hf_folder(folder: Path, config: ModelConfig, seed: int, num_files: int = 1,
                    chat_template: str | None = None) -> dict[str, np.ndarray]:
    """Writes config.json (a Qwen3's if `config.qk_norm`, else a Llama's), tokenizer files (`write_tokenizer_files`)
    and random weights split over `num_files` safetensors; returns them."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = random_hf_tensors(config, seed)
    names = sorted(tensors)
    for i in range(num_files):
        part = names[i * len(names) // num_files:(i + 1) * len(names) // num_files]
        save_file({k: tensors[k] for k in part}, str(folder / f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3" if config.qk_norm else "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "bos_token_id": 1, "eos_token_id": 2,
    }))
    write_tokenizer_files(folder, config.vocab_size, chat_template)
    return tensors


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of its llama arch (the inverse of the loader's un-permute)."""
    head_dim = weights.shape[0] // num_heads
    return weights.reshape(num_heads, 2, head_dim // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_granite_scalars(writer: gguf.GGUFWriter, config: ModelConfig) -> None:
    """`config`'s Granite scalars as llama.cpp's converter writes them (the softmax scale only where given)."""
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    if config.attention_multiplier is not None:
        writer.add_attention_scale(config.attention_multiplier)
    writer.add_logit_scale(config.logits_scaling)


def write_gguf(path: Path, config: ModelConfig, tensors: dict[str, np.ndarray], arch: str = "llama",
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Writes `config`'s model with `tensors` (HF names) as llama.cpp's converter writes it for `arch`: Q/K rows
    permuted for "llama" and "granite", a granite's scalars as their keys, matrices in `qtype`, vectors (norms)
    float32, and `extra` tensors as they are; returns the tensors the file holds, in HF names and order."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokenizer = train_tokenizer(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t.startswith("<") else 1 for t, _ in vocab])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if arch == "granite":
        write_granite_scalars(writer, config)

    expected = {}
    for name, (gguf_suffix, hf_suffix) in {**LAYER_TENSORS, **GLOBAL_TENSORS}.items():
        keys = ([(f"blk.{i}.{gguf_suffix}", f"model.layers.{i}.{hf_suffix}") for i in range(config.num_layers)]
                if name in LAYER_TENSORS else [(gguf_suffix, hf_suffix)])
        for gguf_name, hf_name in keys:
            if hf_name not in tensors:
                continue
            value = tensors[hf_name]
            if value.ndim == 1:
                writer.add_tensor(gguf_name, value)
                expected[hf_name] = value
                continue
            stored = value
            if arch in ("llama", "granite") and name in ("wq", "wk"):
                stored = llama_cpp_permute(value, config.num_heads if name == "wq" else config.num_kv_heads)
            quantized = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name, quantized, raw_shape=quantized.shape, raw_dtype=qtype)
            # Q8_0 rounds within rows and the permutation moves whole rows, so this is what the file holds.
            expected[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
