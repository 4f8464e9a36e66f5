"""`--hf-overrides JSON`, as vLLM's: an object whose keys replace config.json's top-level keys before the model's
config, tokenizer and stop ids are read (a YaRN scaling, as Qwen2.5's and Qwen3's model cards give it, without
editing config.json); each distinct override converted and kept apart from the plain model."""

from __future__ import annotations

import json
import shutil

import jax
import pytest

from hf_folder import random_hf_tensors, write_gguf, write_hf_folder
from sluice.model import checkpoint
from sluice.model.config import ModelConfig, RopeScaling
from sluice.model.fetch import InvalidModel
from sluice.model.loader import load_model, read_source

CONFIG = ModelConfig.tiny(vocab_size=300, head_dim=32, hidden_size=64, num_heads=2, num_kv_heads=1,
                          max_position_embeddings=256)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    """A small HF folder, converted (when a test loads it) under a SLUICE_HOME of the test's own."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_hf_folder(tmp_path / "hf", CONFIG, seed=1)
    return tmp_path / "hf"


def _with_keys(folder, to, **keys):
    """A copy of the HF `folder` at `to` whose config.json has `keys` written into it."""
    shutil.copytree(folder, to)
    written = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**written, **keys}))
    return to


def _conversions(tmp_path):
    return sorted(path.name for path in (tmp_path / "home" / "checkpoints").iterdir())


def test_a_yarn_scaling_given_as_an_override_serves_as_the_same_keys_written_into_config_json(folder, tmp_path):
    overridden = load_model(str(folder), dtype="float32", hf_overrides={"rope_scaling": YARN}).config
    written = load_model(str(_with_keys(folder, tmp_path / "written", rope_scaling=YARN)), dtype="float32").config
    assert overridden == written
    assert (overridden.rope_scaling.kind, overridden.max_position_embeddings) == ("yarn", 4 * 256)


def test_the_folder_loaded_without_overrides_afterwards_is_the_plain_model(folder):
    load_model(str(folder), dtype="float32", hf_overrides={"rope_scaling": YARN})
    assert load_model(str(folder), dtype="float32").config == CONFIG


def test_the_plain_conversion_and_the_overridden_one_are_both_kept(folder, tmp_path):
    """Serving a folder with and without overrides by turns converts each once; an override changed replaces the
    conversion of the earlier one, as a changed source replaces its conversion."""
    home = tmp_path / "home"
    plain = checkpoint.checkpoint_dir(folder, home, "none").name
    yarn = checkpoint.checkpoint_dir(folder, home, "none", {"rope_scaling": YARN}).name
    load_model(str(folder), dtype="float32")
    load_model(str(folder), dtype="float32", hf_overrides={"rope_scaling": YARN})
    assert _conversions(tmp_path) == sorted([plain, yarn])
    load_model(str(folder), dtype="float32")
    assert _conversions(tmp_path) == sorted([plain, yarn])
    halved = {"rope_scaling": {**YARN, "factor": 2.0}}
    load_model(str(folder), dtype="float32", hf_overrides=halved)
    assert _conversions(tmp_path) == sorted([plain, checkpoint.checkpoint_dir(folder, home, "none", halved).name])


def test_the_conversion_is_keyed_by_the_overrides_whatever_their_keys_order(folder, tmp_path):
    home = tmp_path / "home"
    plain = checkpoint.checkpoint_dir(folder, home, "none")
    assert checkpoint.checkpoint_dir(folder, home, "none", {}) == plain
    yarn = checkpoint.checkpoint_dir(folder, home, "none", {"rope_scaling": YARN, "max_position_embeddings": 512})
    assert yarn != plain
    assert checkpoint.checkpoint_dir(folder, home, "none", {"max_position_embeddings": 512, "rope_scaling": YARN}) == yarn
    assert checkpoint.checkpoint_dir(folder, home, "none", {"rope_scaling": {**YARN, "factor": 2.0}}) != yarn


def test_an_overridden_rope_scaling_joins_a_transformers_5_rope_parameters_keeping_its_theta(folder, tmp_path):
    """transformers 5 reads `rope_scaling` as `rope_parameters`: the model card's override scales the model whose
    config.json holds rope_parameters (refused as two scalings otherwise), with that file's theta."""
    written = json.loads((folder / "config.json").read_text())
    del written["rope_theta"]
    (folder / "config.json").write_text(json.dumps({**written, "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 500000.0}}))
    overridden = read_source(folder, {"rope_scaling": YARN}).config
    together = _with_keys(folder, tmp_path / "together", rope_parameters={**YARN, "rope_theta": 500000.0})
    assert overridden == read_source(together).config
    assert (overridden.rope_theta, overridden.rope_scaling.kind) == (500000.0, "yarn")
    assert read_source(folder, {"rope_scaling": None}).config == read_source(folder).config


def test_overrides_replace_top_level_keys_whole(folder):
    """vLLM updates the config's top-level keys: an object given replaces the one there, not merged into it."""
    scaled = _with_keys(folder, folder.parent / "scaled", rope_scaling={**YARN, "beta_fast": 16.0})
    config = read_source(scaled, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}).config
    assert config.rope_scaling == RopeScaling(2.0, kind="linear")


def test_the_stop_ids_read_the_overridden_config(folder):
    assert read_source(folder, {"eos_token_id": [2, 1]}).config.eos_token_ids[:2] == (2, 1)


def test_a_conversion_in_a_child_process_is_given_the_overrides(folder, monkeypatch):
    answers = iter([2])  # a 2-process job's, to the loader's question; then this test's one process, to orbax's
    monkeypatch.setattr(jax, "process_count", lambda: next(answers, 1))
    monkeypatch.setattr("sluice.model.loader.convert", None)  # not in this process
    load_model(str(folder), dtype="float32", hf_overrides={"rope_scaling": YARN})
    restored = load_model(str(folder), dtype="float32", hf_overrides={"rope_scaling": YARN}).config  # the child's
    assert (restored.rope_scaling.kind, restored.max_position_embeddings) == ("yarn", 4 * 256)


def test_an_overridden_rope_theta_replaces_a_transformers_5_rope_parameters_theta(folder):
    """transformers 5 reads the theta from rope_parameters: at the top level, the override was left unread."""
    written = json.loads((folder / "config.json").read_text())
    del written["rope_theta"]
    (folder / "config.json").write_text(json.dumps({**written, "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": 10000.0}}))
    assert read_source(folder, {"rope_theta": 500000.0}).config.rope_theta == 500000.0
    both = read_source(folder, {"rope_theta": 500000.0, "rope_scaling": YARN}).config
    assert (both.rope_theta, both.rope_scaling.kind) == (500000.0, "yarn")


def test_overrides_for_a_gguf_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_gguf(tmp_path / "tiny.gguf", CONFIG, random_hf_tensors(CONFIG, seed=0))
    with pytest.raises(InvalidModel, match=r"^--hf-overrides replaces config\.json's keys, and .*tiny\.gguf is a "
                                           r"GGUF file, whose config is its metadata$"):
        load_model(str(tmp_path / "tiny.gguf"), dtype="float32", hf_overrides={"rope_scaling": YARN})


def test_a_value_of_the_wrong_type_is_refused_in_one_line_naming_the_flag(folder):
    with pytest.raises(InvalidModel) as refused:
        load_model(str(folder), dtype="float32", hf_overrides={"max_position_embeddings": "x"})
    message = str(refused.value)
    assert message == (f'{folder} does not read as a model with --hf-overrides {{"max_position_embeddings":"x"}}: '
                       f"ValueError: config.json's max_position_embeddings must be a positive integer, got 'x'")


def test_serve_run_batch_and_generate_take_the_flag_and_its_variable(monkeypatch, capsys):
    from sluice.app import serve
    from sluice.app.cli import build_parser, main

    given = json.dumps({"rope_scaling": YARN})
    parser = build_parser()
    args = parser.parse_args(["serve", "--hf-overrides", given])
    assert serve.checked_engine_config(args, serve.ENGINE_TUNING_FLAGS).hf_overrides == {"rope_scaling": YARN}
    assert parser.parse_args(["run-batch", "-i", "-", "-o", "-", "--hf-overrides", given]).hf_overrides == {
        "rope_scaling": YARN}
    assert parser.parse_args(["generate", "hi", "--hf-overrides", given]).hf_overrides == {"rope_scaling": YARN}
    monkeypatch.setenv("SLUICE_HF_OVERRIDES", given)
    assert build_parser().parse_args(["serve"]).hf_overrides == {"rope_scaling": YARN}
    monkeypatch.delenv("SLUICE_HF_OVERRIDES")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--hf-overrides" in capsys.readouterr().out


@pytest.mark.parametrize(("value", "words"), [
    ("{oops", "not a JSON object: '{oops'"),
    ("[1, 2]", "not a JSON object: '[1, 2]'"),
])
@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_overrides_that_are_no_json_object_are_refused_in_one_line(capsys, command, value, words):
    from sluice.app.cli import main

    with pytest.raises(SystemExit) as exited:
        main([*command, "--hf-overrides", value])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(errors) == 1
    assert errors[0].startswith(f"sluice {command[0]}: error: argument --hf-overrides: {words}"), errors


def test_serve_refuses_a_value_of_the_wrong_type_in_one_line(folder, monkeypatch, capsys):
    import uvicorn

    from sluice.app.cli import main

    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)  # it would close pytest's handlers
    status = main(["serve", "--port", "0", "--no-ui", "--model", str(folder), "--hf-overrides",
                   '{"max_position_embeddings": "x"}'])
    errors = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and errors[-1].startswith(f"sluice serve: error: {folder} does not read as a model with "
                                                 f"--hf-overrides"), errors
