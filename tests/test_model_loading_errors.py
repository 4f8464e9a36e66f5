"""Models as users have them, read as the libraries that wrote them read them, or refused in one line naming what is
wrong: a tokenizer.json that remembers its truncation, stop tokens in generation_config.json, RoPE scalings and
tensor types Sluice does not implement, a shard or a GGUF split part missing, a folder named with dots."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from hf_folder import random_hf_tensors, train_tokenizer, write_gguf, write_hf_folder, write_tokenizer_files
from sluice.model.config import ModelConfig
from sluice.model.fetch import InvalidModel, ModelNotFound
from sluice.model.loader import load_model
from sluice.model.tokenizer import Tokenizer

CONFIG = ModelConfig.tiny(vocab_size=300, head_dim=32, hidden_size=64, num_heads=2, num_kv_heads=1,
                          max_position_embeddings=256)
TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture()
def folder(tmp_path, monkeypatch) -> Path:
    """A small HF folder (a tokenizer of 291 tokens: `<s>` 1 BOS, `</s>` 2 EOS, `<unk>` 0), converted under a
    SLUICE_HOME of the test's own."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_hf_folder(tmp_path / "hf", CONFIG, seed=1)
    return tmp_path / "hf"


def _edit_json(path: Path, **keys: Any) -> None:
    written = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({k: v for k, v in {**written, **keys}.items() if v is not None}))


def _gguf_with(path: Path, monkeypatch, metadata: dict[str, Any], tensors: dict[str, np.ndarray] | None = None,
               **options: Any) -> Path:
    """`write_gguf`'s file of CONFIG with `metadata` keys added (ints as uint32, floats as float32, strings), by a
    GGUFWriter given `options` as well."""
    adders = {int: gguf.GGUFWriter.add_uint32, float: gguf.GGUFWriter.add_float32, str: gguf.GGUFWriter.add_string}

    class Writer(gguf.GGUFWriter):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs, **options)

        def write_header_to_file(self, *args, **kwargs) -> None:
            for key, value in metadata.items():
                adders[type(value)](self, key, value)
            super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    write_gguf(path, CONFIG, random_hf_tensors(CONFIG, 1) if tensors is None else tensors)
    return path


def test_a_tokenizer_json_that_remembers_a_truncation_and_padding_encodes_prompts_whole(folder):
    """A tokenizer.json saved with truncation and padding on (as a training script leaves it): the library applies
    them to every encode, transformers only where a call asks. Prompts were cut to 4 tokens and padded to 16."""
    whole = load_model(str(folder), dtype="float32").tokenizer.encode(TEXT)
    _edit_json(folder / "tokenizer.json",
               truncation={"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0},
               padding={"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                        "pad_type_id": 0, "pad_token": "<unk>"})
    assert len(whole) > 4
    assert load_model(str(folder), dtype="float32").tokenizer.encode(TEXT) == whole


def test_the_eos_ids_of_generation_config_json_stop_the_model_too(folder):
    """Llama 3 Instruct's first upload: config.json's EOS is <|end_of_text|>, generation_config.json's adds
    <|eot_id|>, which ends each chat turn. Sluice stopped at config.json's alone, and never at a turn's end."""
    _edit_json(folder / "generation_config.json", eos_token_id=[2, 0], temperature=0.6)
    assert load_model(str(folder), dtype="float32").config.eos_token_ids == (2, 0)


@pytest.mark.parametrize(("generation_eos", "stop_ids"), [([2, 0], (2, 0)), (None, (2, 5))],
                         ids=["generation_config.json", "no generation_config.json"])
def test_the_model_stops_at_its_tokenizers_eos_and_its_generation_configs_as_vllm_reads_them(folder, generation_eos,
                                                                                             stop_ids):
    """A fine-tune whose config.json still names the base model's stop ids beside its own generation_config.json:
    vLLM (and transformers) take the generation config from generation_config.json, and from config.json only
    where the folder has none. Sluice stopped at every id of the three files."""
    _edit_json(folder / "config.json", eos_token_id=[2, 5])
    if generation_eos is not None:
        _edit_json(folder / "generation_config.json", eos_token_id=generation_eos)
    assert load_model(str(folder), dtype="float32").config.eos_token_ids == stop_ids


def test_a_tokenizer_with_more_tokens_than_the_models_embeddings_is_served_with_a_warning(tmp_path, monkeypatch,
                                                                                           caplog):
    """A tokenizer paired with another model, or tokens added without resizing the embeddings: as transformers and
    vLLM serve it, the prompts holding ids within the embeddings are served. Embeddings padded past the tokenizer
    (the fixture's 300 rows for 291 tokens) are as models are made, and not warned of."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_hf_folder(tmp_path / "hf", dataclasses.replace(CONFIG, vocab_size=256), seed=1)
    write_tokenizer_files(tmp_path / "hf", 300)
    write_hf_folder(tmp_path / "padded", CONFIG, seed=1)
    with caplog.at_level(logging.WARNING, logger="sluice.model.loader"):
        load_model(str(tmp_path / "hf"), dtype="float32")
        load_model(str(tmp_path / "padded"), dtype="float32")
    assert [record.getMessage() for record in caplog.records] == [
        "the tokenizer's 291 tokens outnumber the model's 256 embedding rows: prompts holding token ids from 256 on "
        "are refused"]


def test_the_eos_token_of_tokenizer_config_json_stops_the_model_and_is_the_templates(folder):
    """A ChatML fine-tune names <|im_end|> its tokenizer's EOS and leaves config.json's as the base model's: vLLM
    stops at the tokenizer's too, and transformers renders it as the template's eos_token."""
    _edit_json(folder / "tokenizer_config.json", eos_token="<unk>", chat_template="{{ eos_token }}")
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.eos_token_ids == (0, 2)
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<unk>"


@pytest.mark.parametrize(("file", "keys", "words"), [
    ("config.json", {"eos_token_id": "</s>"}, "config.json's eos_token_id must be a token id or a list of them, "
                                              "got '</s>'"),
    ("config.json", {"eos_token_id": [2, None]}, "config.json's eos_token_id must be a token id or a list of them, "
                                                 "got [2, None]"),
    ("config.json", {"eos_token_id": 5000}, "config.json's eos_token_id 5000 is not an id of the tokenizer's 291 "
                                            "tokens"),
    ("config.json", {"bos_token_id": True}, "config.json's bos_token_id must be a token id, got True"),
    ("config.json", {"bos_token_id": -1}, "config.json's bos_token_id -1 is not an id of the tokenizer's 291 tokens"),
    ("generation_config.json", {"eos_token_id": [2, 295]}, "generation_config.json's eos_token_id 295 is not an id"),
    ("tokenizer_config.json", {"eos_token": ["</s>"]}, "tokenizer_config.json's eos_token must be a token's text, "
                                                       "got ['</s>']"),
])
def test_special_token_ids_that_are_no_ids_of_the_tokenizer_are_refused_by_name(folder, file, keys, words):
    """A string, a null in a list, an id past the vocabulary: each was kept, and the engine compared sampled ids
    with it (never stopping), or a BOS past the embedding was prepended to every prompt."""
    if "bos_token_id" in keys:
        _edit_json(folder / "tokenizer_config.json", bos_token="<nothing of the vocabulary>")
    _edit_json(folder / file, **keys)
    with pytest.raises(InvalidModel, match=re.escape(words)):
        load_model(str(folder), dtype="float32")


def test_a_gguf_files_end_of_turn_token_stops_the_model(tmp_path, monkeypatch):
    """The tokenizer stopped at tokenizer.ggml.eot_token_id, the engine at the config's EOS alone."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    path = _gguf_with(tmp_path / "m.gguf", monkeypatch, {"tokenizer.ggml.eot_token_id": 0})
    loaded = load_model(str(path), dtype="float32")
    assert loaded.tokenizer.eos_token_ids == (2, 0)
    assert loaded.config.eos_token_ids == (2, 0)


def test_a_folder_named_with_dots_is_served_by_its_whole_name(tmp_path, monkeypatch):
    """Clients ask for the model by name: Qwen2.5-0.5B-Instruct was served as "Qwen2.5-0" (the folder's name less
    what Path takes for a suffix), and requests naming it got 404s."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_hf_folder(tmp_path / "Qwen2.5-0.5B-Instruct", CONFIG, seed=1)
    assert load_model(str(tmp_path / "Qwen2.5-0.5B-Instruct"), dtype="float32").name == "Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize("scaling", [
    {"type": "longrope", "long_factor": [4.0] * 16, "short_factor": [1.5] * 16, "original_max_position_embeddings": 64},
    {"type": "su", "long_factor": [4.0] * 16, "short_factor": [1.5] * 16},
    {"rope_type": "a-future-one", "factor": 1.0},
])
def test_a_rope_scaling_of_a_kind_sluice_does_not_know_is_refused_whatever_its_factor(folder, scaling):
    """LongRoPE divides the frequencies by its short factors at every length, and writes no factor: it was taken
    for no scaling, as an unknown kind was (a llamafied Phi-3 128k served without it)."""
    _edit_json(folder / "config.json", rope_scaling=scaling)
    with pytest.raises(InvalidModel, match=re.escape(f"RoPE scaling of type {scaling.get('type', scaling.get('rope_type'))!r}")):
        load_model(str(folder), dtype="float32")


@pytest.mark.parametrize("scaling", ["linear", 2.0, ["llama3"]])
def test_a_rope_scaling_that_is_no_json_object_is_refused_by_name(folder, scaling):
    """It was an AttributeError's traceback."""
    _edit_json(folder / "config.json", rope_scaling=scaling)
    with pytest.raises(InvalidModel, match=re.escape(f"config.json's rope_scaling must be an object, got {scaling!r}")):
        load_model(str(folder), dtype="float32")


def test_a_llama_3_rope_scaling_missing_a_key_is_refused_naming_it(folder):
    """It was `KeyError: 'low_freq_factor'`, naming neither the file nor the scaling."""
    _edit_json(folder / "config.json", rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64})
    with pytest.raises(InvalidModel, match=re.escape("config.json's rope_scaling of type 'llama3' lacks "
                                                     "low_freq_factor")):
        load_model(str(folder), dtype="float32")


@pytest.mark.parametrize("metadata", [{"llama.rope.scaling.type": "longrope"},
                                      {"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 2.0}])
def test_a_gguf_rope_scaling_sluice_does_not_implement_is_refused_not_ignored(tmp_path, monkeypatch, metadata):
    """Sluice read such a file as unscaled. (Linear and YaRN, which it applies: tests/test_rope_scaling.py.)"""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    path = _gguf_with(tmp_path / "m.gguf", monkeypatch, metadata)
    with pytest.raises(InvalidModel, match="asks for RoPE scaling of type"):
        load_model(str(path), dtype="float32")


@pytest.mark.parametrize("rotated", [CONFIG.head_dim // 2, CONFIG.head_dim])
def test_a_gguf_that_rotates_part_of_each_head_is_refused_not_ignored(tmp_path, monkeypatch, rotated):
    """llama.cpp rotates the first rope.dimension_count dimensions of each head; Sluice rotated them all."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    path = _gguf_with(tmp_path / "m.gguf", monkeypatch, {"llama.rope.dimension_count": rotated})
    if rotated == CONFIG.head_dim:
        assert load_model(str(path), dtype="float32").config.head_dim == CONFIG.head_dim
        return
    with pytest.raises(InvalidModel, match=re.escape("the GGUF metadata's llama.rope.dimension_count of 16 rotates "
                                                     "only part of each head of 32, which Sluice does not implement")):
        load_model(str(path), dtype="float32")


def test_a_gguf_tensor_of_a_type_sluice_cannot_dequantize_is_refused_by_name_before_a_weight_is_read(
        tmp_path, monkeypatch):
    """A float64 norm (gguf's F64): gguf's NotImplementedError was a traceback, after every other tensor was read."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    tensors = random_hf_tensors(CONFIG, 1)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float64)
    path = _gguf_with(tmp_path / "m.gguf", monkeypatch, {}, tensors)
    monkeypatch.setattr("sluice.model.weights._read", None)  # reading the weights fails the test
    with pytest.raises(InvalidModel, match=re.escape("tensor output_norm.weight is of type F64, which Sluice does "
                                                     "not read")):
        load_model(str(path), dtype="float32")


def test_a_shard_the_index_names_but_the_folder_lacks_is_refused_by_name(folder, tmp_path):
    """The index named the shard a download left out; Sluice said the file lacked its first tensor."""
    for path in folder.glob("*.safetensors"):
        path.unlink()
    tensors = write_hf_folder(folder, CONFIG, seed=1, num_files=3)
    weight_map = {name: path.name for path in sorted(folder.glob("*.safetensors")) for name in load_file(str(path))}
    assert len(tensors) == len(weight_map)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(InvalidModel, match=re.escape("model.safetensors.index.json names "
                                                     "model-00002-of-00003.safetensors, which the folder lacks")):
        load_model(str(folder), dtype="float32")


@pytest.mark.parametrize("part", [1, 2])
def test_one_part_of_a_split_gguf_is_refused_by_name(tmp_path, monkeypatch, part):
    """llama.cpp's gguf-split writes a model in parts, the first with the metadata; Sluice said the first part
    lacked a tensor, and the others that they were of architecture None."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    _gguf_with(tmp_path / "m.gguf", monkeypatch, {}, split_max_tensors=10)
    with pytest.raises(InvalidModel, match=re.escape(f"m-0000{part}-of-00003.gguf is part {part} of a GGUF split "
                                                     f"into 3 files: merge them into one")):
        load_model(str(tmp_path / f"m-0000{part}-of-00003.gguf"), dtype="float32")


@pytest.mark.parametrize(("model_type", "eps", "context"), [("llama", 1e-6, 2048), ("mistral", 1e-6, 4096),
                                                            ("qwen2", 1e-6, 32768), ("qwen3", 1e-6, 32768)])
def test_a_config_json_without_rms_norm_eps_or_a_context_gets_transformers_defaults(folder, model_type, eps, context):
    """transformers' defaults for these keys differ by model type (a Mistral's sliding window of 4096 caps its
    context of 131072); Sluice took 1e-5 and 4096 for every type but Qwen3's eps."""
    written = json.loads((folder / "config.json").read_text())
    for key in ("rms_norm_eps", "max_position_embeddings", "head_dim"):
        written.pop(key)
    config = ModelConfig.from_hf({**written, "model_type": model_type, "architectures": []})
    assert (config.rms_norm_eps, config.max_position_embeddings) == (eps, context)


@pytest.mark.parametrize(("pre", "add_bos"), [("llama-bpe", None), ("llama-bpe", False), ("smollm", None)])
def test_a_gguf_tokenizer_adds_a_bos_where_llama_cpp_adds_one(pre, add_bos):
    """A Llama 3 GGUF that does not say whether to add a BOS gets one from llama.cpp; Sluice added none."""
    tokenizer = train_tokenizer(CONFIG.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": [t for t, _ in vocab],
              "tokenizer.ggml.merges": [" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]],
              "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_bos_token": add_bos}
    encoded = Tokenizer.from_gguf_fields({k: v for k, v in fields.items() if v is not None}).encode(TEXT)
    assert (encoded[0] == 1) == (pre == "llama-bpe" and add_bos is None)


def test_a_folder_of_a_gguf_beside_a_config_json_serves_the_gguf(tmp_path, monkeypatch):
    """A GGUF repository may keep the config.json of the model it was converted from: the folder was taken for an
    HF folder, and refused for holding no safetensors."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_hf_folder(tmp_path / "hf", CONFIG, seed=1)
    folder = tmp_path / "Model-GGUF"
    folder.mkdir()
    (folder / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    write_gguf(folder / "model.Q8_0.gguf", CONFIG, random_hf_tensors(CONFIG, 1))
    assert load_model(str(folder), dtype="float32").name == "model.Q8_0"
    (folder / "model.Q8_0.gguf").unlink()
    with pytest.raises(ModelNotFound, match=re.escape(f"{folder} holds config.json but no *.safetensors (Sluice reads "
                                                      f"no pytorch_model.bin) and no .gguf file")):
        load_model(str(folder), dtype="float32")


def test_a_gguf_of_a_tensor_type_newer_than_the_gguf_library_says_it_may_be_newer(tmp_path, monkeypatch):
    """A type number llama.cpp added after the installed gguf: the file was said to be cut short or corrupt, and a
    new download would have been refused alike."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    path = tmp_path / "m.gguf"
    write_gguf(path, CONFIG, random_hf_tensors(CONFIG, 1))
    info = gguf.GGUFReader(str(path)).tensors[0].field  # name length, name, dimensions, shape, type, offset
    at = info.offset + sum(part.nbytes for part in info.parts[:4])
    data = bytearray(path.read_bytes())
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidModel, match=re.escape(f"not a whole GGUF file (cut short or corrupt), or one newer than "
                                                     f"gguf {importlib.metadata.version('gguf')} reads: ValueError: "
                                                     f"np.uint32(99) is not a valid GGMLQuantizationType")):
        load_model(str(path), dtype="float32")
