"""The event loop stays free while a request is built: compiling a structured output's grammar and rendering and
encoding a prompt run in worker threads, so `/health` and other streams answer meanwhile, and a client that
leaves during the build does not leave its request behind in the engine. The tiny random model with SmolLM2's vocabulary (llguidance needs the
model's logits to cover the tokenizer), in-process."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import pytest
from flax import nnx

from sluice.app.server import create_app
from sluice.batching.engine import Engine
from sluice.batching.structured import GrammarCompiler
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from sluice.model.tokenizer import Tokenizer

from test_server_engine import CONFIG, serve

# What a large schema's compilation is made to take (unless released sooner): a real schema compiles in
# milliseconds once llguidance's tokenizer is built, too fast to show a stall reliably.
COMPILE_S = 2.0
SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(200)},
          "required": [f"field_{i}" for i in range(200)], "additionalProperties": False}
STRUCTURED = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": SCHEMA}}}


@pytest.fixture(scope="module")
def engine(smollm2) -> Engine:
    tiny = ModelConfig.tiny(vocab_size=smollm2.config.vocab_size)
    loaded = LoadedModel(tiny, Llama(tiny, rngs=nnx.Rngs(0)), smollm2.tokenizer, "tiny")
    return Engine(loaded, CONFIG, progress=False)


@dataclass
class SlowWork:
    """Work (grammar compilations, a prompt's encoding) that takes COMPILE_S, or until `release` is set;
    `started_at` is the last one's start."""

    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0


@pytest.fixture
def slow_compiles(monkeypatch) -> SlowWork:
    slow = SlowWork()
    real = GrammarCompiler.compile

    def compile(self, spec):
        slow.started_at = time.perf_counter()
        slow.started.set()
        slow.release.wait(COMPILE_S)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", compile)
    return slow


def health_while(engine: Engine, path: str, body: dict, work: SlowWork):
    """(/health's response, seconds from the start of `work` to it, the response to `body`) when /health is asked
    while the request to `path` does its slow work."""

    async def scenario(client, state):
        slow = asyncio.create_task(client.post(path, json=body))
        await asyncio.to_thread(work.started.wait, COMPILE_S)
        health = await client.get("/health")
        answered_s = time.perf_counter() - work.started_at
        work.release.set()
        return health, answered_s, await slow

    return serve(engine, scenario)


def test_health_answers_at_once_while_a_large_schema_compiles(engine, slow_compiles):
    health, answered_s, structured = health_while(engine, "/v1/completions", STRUCTURED, slow_compiles)
    assert health.status_code == 200 and answered_s < 0.5
    assert structured.status_code == 200 and structured.json()["choices"][0]["finish_reason"] == "length"


# A prompt whose encoding is made to take COMPILE_S (unless released sooner): a megabyte of text takes a second.
SLOW = "a slow prompt"
SLOW_PROMPTS = {
    "/v1/completions": {"prompt": SLOW, "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": SLOW}], "max_tokens": 2},
    "/v1/embeddings": {"input": SLOW},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": SLOW}]},
    "/tokenize": {"prompt": SLOW},
}


@pytest.mark.parametrize("path", list(SLOW_PROMPTS))
def test_health_answers_at_once_while_a_prompt_is_encoded(engine, monkeypatch, path):
    slow_encodes = SlowWork()
    real = Tokenizer.encode

    def encode(self, text, **kwargs):
        if SLOW in text:
            slow_encodes.started_at = time.perf_counter()
            slow_encodes.started.set()
            slow_encodes.release.wait(COMPILE_S)
        return real(self, text, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    health, answered_s, slow = health_while(engine, path, SLOW_PROMPTS[path], slow_encodes)
    assert health.status_code == 200 and answered_s < 0.5
    assert slow.status_code == 200, slow.text


def test_a_long_text_is_encoded_without_holding_the_gil(engine):
    """A worker thread's encoding leaves the other threads (the event loop's) running: only the ids' list is built
    under the GIL."""
    text = "the quick brown fox jumps over the lazy dog. " * 20_000  # 900 kB
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    began = time.perf_counter()
    ids = engine.tokenizer.encode(text)
    took = time.perf_counter() - began
    done.set()
    ticker.join()
    assert len(ids) > 100_000 and max(gaps) < took / 2


async def post_then_leave(app, body: dict, leave: threading.Event) -> list[dict]:
    """POSTs `body` to /v1/completions over raw ASGI and disconnects once `leave` is set: the messages sent."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "server": ("sluice", 80), "client": ("client", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    requests = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if requests:
            return requests.pop()
        await asyncio.to_thread(leave.wait, COMPILE_S)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_a_client_that_leaves_while_its_request_compiles_gets_it_aborted_once_built(engine, slow_compiles,
                                                                                    monkeypatch):
    calls: list[tuple[str, str]] = []
    real_submit, real_abort = engine.submit, engine.abort

    def submit(prompts, params, sink, request_id):
        real_submit(prompts, params, sink, request_id)
        calls.append(("submitted", request_id))

    def abort(request_id):
        calls.append(("aborted", request_id))
        real_abort(request_id)

    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine, "abort", abort)

    async def scenario(client, state):
        sent = await post_then_leave(create_app(state), STRUCTURED, slow_compiles.started)
        slow_compiles.release.set()
        idle = await state.wait_idle(COMPILE_S)  # the admission is released once the build has ended
        return sent, idle

    sent, idle = serve(engine, scenario)
    assert sent[0]["status"] == 499 and idle
    request_id = calls[0][1]
    assert calls == [("submitted", request_id), ("aborted", request_id)]
