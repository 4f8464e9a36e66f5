"""An HF model folder's files as Sluice reads them: its JSON files through one reader (each caller saying whether
the file may be missing), its sliding window as a bound on the context, and a conversion in a child process
refusing a model as the in-process one does."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import jax
import pytest

from hf_folder import write_hf_folder
from sluice.batching.config import EngineConfig, InvalidEngineConfig
from sluice.batching.kv_pool import resolve_max_model_len
from sluice.model.config import ModelConfig, RopeScaling, read_json_object
from sluice.model.fetch import InvalidModel, ModelNotFound
from sluice.model.generation_config import from_hf_folder
from sluice.model.loader import load_model
from sluice.model.tokenizer import Tokenizer

CONFIG = ModelConfig.tiny(vocab_size=300, head_dim=32, hidden_size=64, num_heads=2, num_kv_heads=1,
                          max_position_embeddings=256)
JSON_FILES = ["config.json", "tokenizer_config.json", "generation_config.json"]


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    """A small HF folder, converted (when a test loads it) under a SLUICE_HOME of the test's own."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_hf_folder(tmp_path / "hf", CONFIG, seed=1)
    return tmp_path / "hf"


def _edit_config(folder, **keys):
    written = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**written, **keys}))


def _refusal(model: str) -> str:
    with pytest.raises((InvalidModel, ModelNotFound)) as refused:
        load_model(model, dtype="float32")
    return f"{type(refused.value).__name__}: {refused.value}"


@pytest.mark.parametrize("name", JSON_FILES)
@pytest.mark.parametrize(("content", "words"), [
    (b"[1, 2]", "holds an array, not a JSON object"),
    (b'"config"', "holds a string, not a JSON object"),
    (b"null", "holds null, not a JSON object"),
    (b"{oops", "is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (b"\xff{}", "is not JSON: 'utf-8' codec can't decode byte 0xff in position 0"),
])
def test_each_json_file_that_is_no_json_object_is_refused_in_one_line_naming_it(folder, name, content, words):
    (folder / name).write_bytes(content)
    message = _refusal(str(folder))
    assert message.startswith(f"InvalidModel: {folder} does not read as a model: ValueError: {name} {words}")
    assert "\n" not in message


def test_a_missing_config_json_is_an_error_naming_it():
    """resolve_model finds no HF folder without config.json; convert's reader refuses one all the same."""
    with pytest.raises(ValueError, match=r"^/nowhere has no config\.json$"):
        read_json_object(Path("/nowhere/config.json"), missing_ok=False)


def test_a_folder_without_tokenizer_config_or_generation_config_json_reads_without_them(folder):
    (folder / "tokenizer_config.json").unlink()
    hf_config = read_json_object(folder / "config.json", missing_ok=False)
    tokenizer = Tokenizer.from_hf_folder(folder, hf_config)
    assert (tokenizer.special.bos_token_id, tokenizer.special.eos_token_ids) == (1, (2,))  # config.json's
    assert tokenizer.special.chat_template is None
    assert from_hf_folder(folder) == {}


def test_a_sliding_window_shorter_than_the_context_caps_it_with_a_warning(folder, caplog):
    _edit_config(folder, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    with caplog.at_level(logging.WARNING, logger="sluice.model.config"):
        loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.max_position_embeddings == 64
    assert "sliding_window of 64 tokens is shorter than its context of 256" in caplog.text
    assert "capped at 64 tokens" in caplog.text


def test_max_model_len_beyond_the_sliding_window_is_refused_and_the_default_fits_it(folder):
    """The engine's check against the model's context applies to the window: attention past it is not the model's."""
    _edit_config(folder, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    model = load_model(str(folder), dtype="float32").config
    with pytest.raises(InvalidEngineConfig, match="max_model_len 128 exceeds the model's context of 64 tokens"):
        resolve_max_model_len(EngineConfig(max_model_len=128, page_size=16), model, num_pages=64)
    assert resolve_max_model_len(EngineConfig(max_model_len=64, page_size=16), model, num_pages=64) == 64
    assert resolve_max_model_len(EngineConfig(page_size=16), model, num_pages=64) == 64


def test_max_model_len_past_what_the_kv_pool_holds_is_refused_and_the_default_is_cut_to_it():
    """As vLLM refuses it at start: the context served (the model card's max_input_tokens) is one the pool holds."""
    model = ModelConfig.tiny()
    with pytest.raises(InvalidEngineConfig, match=r"max_model_len 257 exceeds the 256 tokens the KV pool holds "
                                                  r"\(16 pages of 16\): a larger --kv-cache-memory"):
        resolve_max_model_len(EngineConfig(max_model_len=257, page_size=16), model, num_pages=16)
    assert resolve_max_model_len(EngineConfig(max_model_len=256, page_size=16), model, num_pages=16) == 256
    assert resolve_max_model_len(EngineConfig(page_size=16), model, num_pages=16) == 256


@pytest.mark.parametrize("keys", [
    {"model_type": "mistral", "sliding_window": None},  # Mistral 7B v0.2 and later
    {"model_type": "mistral", "sliding_window": 256},
    {"model_type": "mistral", "sliding_window": 4096},
    {"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False},  # Qwen2's, unused
    {"model_type": "qwen2", "sliding_window": 64},  # use_sliding_window is false unless set
    {"model_type": "qwen3", "sliding_window": 64},  # as Qwen2's
])
def test_no_sliding_window_or_one_that_the_context_fits_changes_nothing(folder, caplog, keys):
    _edit_config(folder, **keys)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert config.max_position_embeddings == 256
    assert "sliding_window" not in caplog.text


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_sliding_window_a_qwen_uses_caps_the_context(folder, model_type):
    _edit_config(folder, model_type=model_type, sliding_window=64, use_sliding_window=True)
    assert ModelConfig.from_hf(json.loads((folder / "config.json").read_text())).max_position_embeddings == 64


def test_a_transformers_5_config_json_gives_its_rope_theta_and_scaling_in_rope_parameters(folder):
    """transformers 5 writes no rope_theta or rope_scaling key: both are in rope_parameters (a theta read as the
    default 10000 served another model)."""
    written = json.loads((folder / "config.json").read_text())
    del written["rope_theta"]
    written["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = ModelConfig.from_hf(written)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, RopeScaling(8.0, 1.0, 4.0, 64))


@pytest.mark.parametrize("where", ["top level", "rope_parameters"])
def test_a_partial_rotary_factor_is_refused_not_ignored(folder, where):
    """transformers rotates only that share of each head's dimensions; Sluice rotated them all."""
    written = json.loads((folder / "config.json").read_text())
    if where == "top level":
        written["partial_rotary_factor"] = 0.5
    else:
        written["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=r"^config.json's partial_rotary_factor of 0.5 rotates only part of each "
                                         r"head, which Sluice does not implement$"):
        ModelConfig.from_hf(written)
    written.pop("partial_rotary_factor", None)
    written.get("rope_parameters", {})["partial_rotary_factor"] = 1.0
    assert ModelConfig.from_hf(written).head_dim == CONFIG.head_dim  # 1.0: the whole head, as RoPE always is


def test_a_partial_rotary_factor_of_1_in_a_yarn_scaling_is_the_whole_head(folder):
    """transformers 5 saves a top-level partial_rotary_factor into rope_parameters: 1 there was refused as unread."""
    written = json.loads((folder / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    plain = ModelConfig.from_hf({**written, "rope_parameters": yarn})
    assert ModelConfig.from_hf({**written, "rope_parameters": {**yarn, "partial_rotary_factor": 1.0}}) == plain


def test_rope_parameters_per_layer_type_are_refused_not_read_as_none(folder):
    """transformers 5 takes rope_parameters keyed by layer type; Sluice found no rope_type there and served plain
    RoPE."""
    written = json.loads((folder / "config.json").read_text())
    per_layer = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=r"^config.json's rope_parameters holds one per layer type \(full_attention\), "
                                         r"which Sluice does not implement$"):
        ModelConfig.from_hf({**written, "rope_parameters": per_layer})


@pytest.mark.parametrize("window", [0, -1, 4.5, "4096", True])
def test_a_sliding_window_not_a_positive_integer_is_refused(folder, window):
    _edit_config(folder, model_type="mistral", sliding_window=window)
    with pytest.raises(ValueError, match=re.escape(f"config.json's sliding_window must be a positive integer, got "
                                                   f"{window!r}")):
        ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize("damage", [
    lambda folder, tmp_path: (folder / "config.json").write_text("{oops"),
    lambda folder, tmp_path: (folder / "tokenizer_config.json").write_text("[]"),
    lambda folder, tmp_path: (tmp_path / "home").write_text("a file"),  # ModelNotFound: no folder can be written
], ids=["config.json not JSON", "tokenizer_config.json an array", "SLUICE_HOME a file"])
def test_a_conversion_in_a_child_process_refuses_a_model_as_the_in_process_one_does(folder, tmp_path, monkeypatch,
                                                                                    damage):
    """In a multi-process job each process converts in a child Python of its own: a model it refused was a
    CalledProcessError's traceback, after the child's own."""
    damage(folder, tmp_path)
    in_process = _refusal(str(folder))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert _refusal(str(folder)) == in_process


def test_a_conversion_in_a_child_process_loads_the_same_model(folder, monkeypatch):
    answers = iter([2])  # a 2-process job's, to the loader's question; then this test's one process, to orbax's
    monkeypatch.setattr(jax, "process_count", lambda: next(answers, 1))
    monkeypatch.setattr("sluice.model.loader.convert", None)  # not in this process
    assert load_model(str(folder), dtype="float32").config == CONFIG
