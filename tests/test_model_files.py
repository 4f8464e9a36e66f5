"""An HF model folder's files as Sluice reads them: its JSON files through one reader (each caller saying whether
the file may be missing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_folder import write_hf_folder
from sluice.model.config import ModelConfig, read_json_object
from sluice.model.fetch import InvalidModel
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


def _refusal(model: str) -> str:
    with pytest.raises(InvalidModel) as refused:
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
