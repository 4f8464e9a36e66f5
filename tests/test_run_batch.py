"""`sluice run-batch` as a user runs it (in this process, as `main` runs it): a file of OpenAI Batch requests
through the server's own app, on a tiny random model with a ChatML template."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from sluice.app import run_batch, serve
from sluice.app.cli import build_parser, main
from sluice.app.engine_loading import load_engine
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.engine import Engine
from sluice.batching.stats import EngineStats
from sluice.model.config import ModelConfig

from conftest import home_with_built_kernels
from hf_folder import CHATML, write_hf_folder

# Prefix caching off: the answers sent to the app again, to compare, would count the batch's pages as cached.
ENGINE_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--kv-cache-memory", "4MiB", "--disable-prefix-caching", "--served-model-name", "tiny"]
GREEDY = {"temperature": 0, "max_tokens": 8}
CHAT = {"messages": [{"role": "user", "content": "the quick brown fox"}], **GREEDY}
# What the server answers: each kind of route, and a body it refuses.
SENT = [
    ("chat", "/v1/chat/completions", CHAT),
    ("completion", "/v1/completions", {"prompt": "the lazy dog", "n": 2, **GREEDY}),
    ("embedding", "/v1/embeddings", {"input": ["the quick brown fox", "jumps over"]}),
    ("response", "/v1/responses", {"input": "the quick brown", "max_output_tokens": 8, "temperature": 0}),
    ("message", "/v1/messages", {"model": "tiny", **CHAT}),
    ("token ids", "/v1/completions", {"prompt": [5, 6, 7], **GREEDY}),
    ("token ids' embedding", "/v1/embeddings", {"input": [[5, 6, 7]]}),
    ("refused", "/v1/chat/completions", {"messages": [], "max_tokens": 8}),
    ("other model", "/v1/chat/completions", {"model": "gpt-4o", **CHAT}),
]
# Lines run-batch answers itself, among those it sends: (the line, its custom_id in the output, the error's code).
NOT_SENT = [
    (b"{not json", None, "invalid_json_line"),
    (b'["a", "list"]', None, "invalid_json_line"),
    (b'{"custom_id": "latin-1 \xe9", "method": "POST"}', None, "invalid_json_line"),
    (b'{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {}}', "chat",
     "duplicate_custom_id"),
    (b'{"custom_id": "moderation", "method": "POST", "url": "/v1/moderations", "body": {"input": "hi"}}',
     "moderation", "invalid_url"),
    (b'{"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}', "get", "invalid_method"),
    (b'{"custom_id": "bodiless", "method": "POST", "url": "/v1/completions"}', "bodiless",
     "missing_required_parameter"),
    (b'{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}', None, "invalid_type"),
    (json.dumps({"custom_id": "streamed", "method": "POST", "url": "/v1/chat/completions",
                 "body": {**CHAT, "stream": True}}).encode(), "streamed", "stream_not_supported"),
]


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


# The lines, those not sent between those sent.
LINES = [line for sent, not_sent in zip(SENT, NOT_SENT, strict=True) for line in (batch_line(*sent), not_sent[0])]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The tiny model's folder, converted into a SLUICE_HOME of this module's (with the built CPU kernels)."""
    folder = tmp_path_factory.mktemp("batch") / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(vocab_size=288), seed=5, chat_template=CHATML)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLUICE_HOME", str(home_with_built_kernels(tmp_path_factory.mktemp("home"))))
        yield folder


@pytest.fixture(scope="module")
def loaded(model) -> list[Engine]:
    """The engines run-batch loads, as it loads them."""
    engines: list[Engine] = []

    def load_and_keep(*args, **kwargs):
        engine, peaks = load_engine(*args, **kwargs)
        engines.append(engine)
        return engine, peaks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_batch, "load_engine", load_and_keep)
        yield engines


def run_batch_command(model: Path, *args: str) -> int:
    return main(["run-batch", *args, "--model", str(model), *ENGINE_FLAGS])


@dataclass(frozen=True)
class Batch:
    """A run's output lines, the engine that answered them, and as the run left them its stats and the threads
    alive."""

    outputs: list[dict[str, Any]]
    engine: Engine
    stats: EngineStats
    threads: list[str]


@pytest.fixture(scope="module")
def batch(model, loaded, tmp_path_factory) -> Batch:
    """A run over a file of LINES. The server's variables for an API key and a waiting queue of 0 are set, which
    the runner, the server's only client, must not be held to."""
    folder = tmp_path_factory.mktemp("files")
    (folder / "in.jsonl").write_bytes(b"\n".join(LINES) + b"\n\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLUICE_API_KEY", "offline")
        env.setenv("SLUICE_MAX_WAITING", "0")
        status = run_batch_command(model, "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"))
    assert status == 0
    engine = loaded[-1]
    outputs = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    return Batch(outputs, engine, engine.stats, [thread.name for thread in threading.enumerate()])


def answered_directly(engine: Engine, requests: list[tuple[str, str, dict[str, Any]]]) -> list[httpx.Response]:
    """The app's answers to `requests` (sent at once, as a client of `sluice serve` sends them), from `engine`."""

    async def send() -> list[httpx.Response]:
        state = ServerState(ServerSettings(ui=False))
        await engine.start()
        state.set_engine(engine)
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://sluice") as client:
                # Bounded: an engine the batch left running would deliver to the batch's closed event loop.
                return await asyncio.wait_for(
                    asyncio.gather(*(client.post(url, json=body) for _, url, body in requests)), 60)
        finally:
            await engine.shutdown()

    return asyncio.run(send())


def without_ids(body: Any) -> Any:
    """`body` less what differs between two answers to one request: ids and creation times."""
    if isinstance(body, dict):
        return {k: without_ids(v) for k, v in body.items() if k not in ("id", "created", "created_at")}
    if isinstance(body, list):
        return [without_ids(item) for item in body]
    return body


def test_each_line_gets_one_output_line_in_input_order(batch):
    outputs = batch.outputs
    assert [o["custom_id"] for o in outputs] == [custom_id for sent, not_sent in zip(SENT, NOT_SENT)
                                                for custom_id in (sent[0], not_sent[1])]
    assert all(o["id"].startswith("batch_req_") for o in outputs) and len({o["id"] for o in outputs}) == len(LINES)


def test_each_request_sent_gets_the_servers_own_answer_with_its_status_and_request_id(batch):
    sent = batch.outputs[::2]
    direct = answered_directly(batch.engine, SENT)
    assert [o["response"]["status_code"] for o in sent] == [r.status_code for r in direct] == \
        [200] * 7 + [400, 404]
    assert all(o["error"] is None and len(o["response"]["request_id"]) == 32 for o in sent)
    for output, response in zip(sent, direct):
        body, expected = output["response"]["body"], response.json()
        if expected.get("object") == "list":  # embeddings, batched otherwise than sent again: equal to float32's rounding
            np.testing.assert_allclose([d["embedding"] for d in body.pop("data")],
                                       [d["embedding"] for d in expected.pop("data")], atol=1e-5)
        assert without_ids(body) == without_ids(expected), output["custom_id"]
    assert all(o["response"]["body"]["usage"] for o in sent[:7])


def test_a_line_that_is_no_request_to_send_gets_its_error_and_no_response(batch):
    refused = batch.outputs[1::2]
    assert [(o["custom_id"], o["error"]["code"]) for o in refused] == [(custom_id, code)
                                                                       for _, custom_id, code in NOT_SENT]
    assert all(o["response"] is None and o["error"]["message"] for o in refused)


def test_the_lines_run_together_in_the_engines_batch(batch):
    """A step decoded more sequences than any one request holds (the completion's n of 2)."""
    decode_batch_steps = batch.stats.decode_batch_steps
    assert max(size for size, steps in enumerate(decode_batch_steps) if steps) > 2, decode_batch_steps


def test_the_engine_is_left_with_no_pages_held_and_its_thread_stopped(batch):
    assert batch.stats.kv_pages_used == 0 and batch.stats.num_requests_running == 0
    assert "sluice-engine" not in batch.threads


def test_stdin_in_and_stdout_out_carry_jsonl_alone(model, loaded, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(batch_line(*SENT[0]) + b"\n")))
    assert run_batch_command(model, "-i", "-", "-o", "-") == 0
    [output] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert output["custom_id"] == "chat" and output["response"]["body"]["object"] == "chat.completion"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("flags", "shown"), [([], True), (["--no-progress"], False)])
def test_a_terminal_is_shown_the_batchs_progress_unless_told_not_to(model, loaded, tmp_path, monkeypatch, flags,
                                                                    shown):
    (tmp_path / "in.jsonl").write_bytes(batch_line(*SENT[0]))
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert run_batch_command(model, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *flags) == 0
    assert ("Running batch: 100%" in sys.stderr.getvalue()) == shown


@pytest.mark.parametrize(("args", "words"), [
    (["-i", "{tmp}/missing.jsonl"], "cannot read {tmp}/missing.jsonl: No such file or directory"),
    (["-i", "{tmp}"], "cannot read {tmp}: Is a directory"),
    (["-o", "{tmp}/missing/out.jsonl"], "cannot write {tmp}/missing/out.jsonl: No such file or directory"),
    (["--page-size", "48"], "--page-size must be a power of two"),
])
def test_what_run_batch_cannot_run_is_a_one_line_error_before_the_model_loads(model, loaded, tmp_path, capsys, args,
                                                                              words):
    """An input it cannot read, an output it cannot write, an engine flag `sluice serve` refuses: exit 2 and one
    line, before minutes of loading. (The last -i or -o given is the one taken.)"""
    (tmp_path / "in.jsonl").write_bytes(batch_line(*SENT[0]))
    engines_before = len(loaded)
    given = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    assert run_batch_command(model, "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *given) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    said = f"sluice run-batch: error: {words.replace('{tmp}', str(tmp_path))}"
    assert len(errors) == 1 and errors[0].startswith(said), errors
    assert len(loaded) == engines_before


def test_help_lists_the_engines_flags_and_none_of_the_servers_own(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run-batch", "--help"])
    shown = capsys.readouterr().out
    assert exited.value.code == 0
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", shown))
    assert {"--max-num-seqs", "--quantization", "--reasoning-parser"} <= flags
    assert not {"--port", "--api-key", "--replicas", "--hosts", "--max-waiting", "--no-ui"} & flags


@pytest.mark.parametrize("flag", ["--replicas", "--hosts", "--num-processes", "--api-key", "--port"])
def test_a_flag_of_the_servers_own_is_a_one_line_error_before_the_model_loads(model, loaded, capsys, flag):
    """Said by run-batch, with its --help (argparse's own would be the top parser's: `sluice`'s). (The flag's value
    reads as the MODEL argument.)"""
    engines_before = len(loaded)
    with pytest.raises(SystemExit) as exited:
        main(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", str(model), flag, "2"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and errors == [f"sluice run-batch: error: unrecognized arguments: {flag} "
                                                 f"(see sluice run-batch --help)"]
    assert len(loaded) == engines_before


def batch_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", *flags])


def test_the_servers_own_variables_are_not_the_runners(monkeypatch):
    """Not even read: one its flag would refuse stops nothing."""
    monkeypatch.setenv("SLUICE_PORT", "not a port")
    monkeypatch.setenv("SLUICE_API_KEY", "key")
    assert not {"port", "api_key"} & set(vars(batch_args()))


def test_the_runner_is_held_to_no_key_queue_bound_or_body_limit_and_asks_for_no_dashboard():
    """Nor a 413 for a line it holds read already; the dashboard's roofline would be measured at start-up, seconds
    for nothing."""
    settings = run_batch.batch_settings(batch_args())
    assert (settings.api_key, settings.max_waiting, settings.max_body_bytes, settings.ui) == \
        (None, sys.maxsize, sys.maxsize, False)


def test_the_flags_that_shape_answers_are_the_runners_as_the_servers():
    flags = ["--served-model-name", "tiny", "--generation-config", "vllm", "--tool-call-parser", "hermes",
             "--exclude-tools-when-tool-choice-none", "--reasoning-parser", "qwen3", "--embedding-pooling", "mean"]
    served = serve.server_settings(build_parser().parse_args(["serve", *flags]))
    batched = run_batch.batch_settings(batch_args(*flags))
    for name in ("served_model_name", "generation_config", "tool_call_parser", "exclude_tools_when_tool_choice_none",
                 "reasoning_parser", "embedding_pooling"):
        assert getattr(batched, name) == getattr(served, name) != getattr(ServerSettings(), name), name
