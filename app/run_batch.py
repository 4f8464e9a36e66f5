"""`sluice run-batch`: a file of OpenAI Batch requests answered offline (vLLM's `vllm run-batch`).

Each line of the input, `{"custom_id", "method": "POST", "url", "body"}`, goes through the very app `sluice serve`
builds, in this process (httpx's ASGI transport, no socket), so each answer is the one the server would give; as many
lines at a time as fill the engine's batch twice over, so that the continuous batcher runs them together. The output
holds one Batch output line per input line, in input order: `response` the server's answer (its status, the
request's id and the JSON body, an error's too), or `error` for a line that is not a request to send (not JSON, a
field missing, a method or URL not served, a `custom_id` already used, `stream` asked for).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import httpx
from starlette.types import ASGIApp, Message
from tqdm import tqdm

from sluice.app import serve
from sluice.app.arguments import CommandError, claim_gpu_memory
from sluice.app.engine_loading import load_engine
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.config import InvalidEngineConfig
from sluice.batching.engine import Engine
from sluice.model.fetch import InvalidModel, ModelNotFound
from sluice.sharding.mesh import InvalidTensorParallelism

PROG = "sluice run-batch"
# The routes a batch line may name: those that answer one request with one JSON body (OpenAI's Batch API takes the
# first four; Anthropic's Messages are served as `sluice serve` serves them).
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages")
# (field, type, the type in words) of a batch input line, in the order they are checked.
FIELDS = (("custom_id", str, "a string"), ("method", str, "a string"), ("url", str, "a string"),
          ("body", dict, "a JSON object"))


@dataclass(frozen=True)
class BatchRequest:
    """A line to send: `body` POSTed to `url`."""

    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Refusal:
    """A line not sent, answered with OpenAI's Batch output `error` (`custom_id` None where the line holds none)."""

    custom_id: str | None
    code: str
    message: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True,
                        help="OpenAI Batch input, JSONL: one {custom_id, method, url, body} a line ('-': stdin)")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the Batch output goes, JSONL: one line per input line, in order ('-': stdout)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (there are none either when stderr is not a terminal)")
    serve.add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # jax's GPU allocator reads its share once, when its backend starts: nothing before this line has started it.
    if (ignored := claim_gpu_memory(args.gpu_memory_utilization, os.environ)) is not None:
        print(f"{PROG}: {ignored}", file=sys.stderr)
    try:
        _run(args)
    except (CommandError, ModelNotFound, InvalidModel, InvalidEngineConfig, InvalidTensorParallelism) as error:
        print(f"{PROG}: error: {serve.said_by_flag(error)}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> None:
    engine_config = serve.checked_engine_config(args, serve.ENGINE_TUNING_FLAGS)
    lines = _read_lines(args.input_file)
    settings = batch_settings(args)
    progress = not args.no_progress and sys.stderr.isatty()
    with _output(args.output_file) as out:
        engine, _ = load_engine(engine_config, ui=settings.ui, declared=None, progress=progress)
        asyncio.run(answer_all(engine, settings, lines, out, progress))


def batch_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings for the runner, its only client: those that shape answers as the flags give them, the
    server's own at their defaults (no API key to ask it for) but no dashboard, and no bound on the waiting queue
    nor on a request's body, as the runner bounds what it sends at once (a 429 would be its own overload) and holds
    each line read already (a 413 would spare nothing)."""
    return replace(serve.answer_settings(args), ui=False, max_waiting=sys.maxsize, max_body_bytes=sys.maxsize)


def _read_lines(path: str) -> list[bytes]:
    """The input's lines that hold anything (bytes: each is decoded as JSON reads it, and one that is not UTF-8 is
    that line's error alone)."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as error:
        raise CommandError(f"cannot read {path}: {error.strerror}") from None
    return [line for line in data.splitlines() if line.strip()]


@contextmanager
def _output(path: str) -> Iterator[TextIO]:
    if path == "-":
        yield sys.stdout
        return
    try:
        out = open(path, "w", encoding="utf-8")
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror}") from None
    with out:
        yield out


async def answer_all(engine: Engine, settings: ServerSettings, lines: list[bytes], out: TextIO,
                     progress: bool) -> None:
    """Serves `engine` in the app `sluice serve` builds for the time it takes to answer `lines` into `out`; the
    app's lifespan stops the engine after, as at a server's shutdown."""
    state = ServerState(settings)
    app = create_app(state, cors=False)
    async with lifespan(app):
        await engine.start()
        state.set_engine(engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sluice") as client:
            await answer_lines(client, lines, out, 2 * engine.config.max_num_seqs, progress)


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Runs `app`'s ASGI lifespan as uvicorn runs it (httpx's transport does not): its startup before the body, its
    shutdown after it, however the body ends."""
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()
    running = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                        to_app.get, from_app.put))
    await to_app.put({"type": "lifespan.startup"})
    started = await from_app.get()
    if started["type"] != "lifespan.startup.complete":
        await running  # Starlette's raises what failed its startup; an app may also return
        raise RuntimeError(f"the app failed to start: {started.get('message', '')}")
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        await running


async def answer_lines(client: httpx.AsyncClient, lines: list[bytes], out: TextIO, concurrency: int,
                       progress: bool) -> None:
    """Writes each line's Batch output line to `out` in input order, sending at most `concurrency` at a time."""
    seen: set[str] = set()
    slots = asyncio.Semaphore(concurrency)
    pending: deque[asyncio.Future[dict[str, Any]]] = deque()
    with tqdm(total=len(lines), desc="Running batch", unit="req", disable=not progress) as bar:

        def answered(_: asyncio.Future[dict[str, Any]]) -> None:
            slots.release()
            bar.update()

        for line in lines:
            await slots.acquire()
            answering = asyncio.ensure_future(answer(client, read_request(line, seen)))
            answering.add_done_callback(answered)
            pending.append(answering)
            while pending and pending[0].done():
                _write(out, pending.popleft().result())
        while pending:
            _write(out, await pending.popleft())
    out.flush()


def _write(out: TextIO, output: dict[str, Any]) -> None:
    out.write(json.dumps(output) + "\n")


def read_request(line: bytes, seen: set[str]) -> BatchRequest | Refusal:
    """The request `line` holds, or why it is not one; `seen` collects the custom_ids read so far, so that a line
    repeating one is refused."""
    try:
        fields = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return Refusal(None, "invalid_json_line", "This line is not parseable as valid JSON.")
    if not isinstance(fields, dict):
        return Refusal(None, "invalid_json_line", "This line is not a JSON object.")
    custom_id = fields.get("custom_id") if isinstance(fields.get("custom_id"), str) else None
    if custom_id in seen:
        return Refusal(custom_id, "duplicate_custom_id", f"custom_id {custom_id!r} is an earlier line's too: each "
                                                         f"line's must be its own")
    if custom_id is not None:
        seen.add(custom_id)
    for name, kind, said in FIELDS:
        if name not in fields:
            return Refusal(custom_id, "missing_required_parameter", f"Missing required parameter: '{name}'.")
        if not isinstance(fields[name], kind):
            return Refusal(custom_id, "invalid_type", f"{name} must be {said}, got {json.dumps(fields[name])}")
    if fields["method"] != "POST":
        return Refusal(custom_id, "invalid_method", f"method {fields['method']!r}: only POST is supported")
    if fields["url"] not in URLS:
        return Refusal(custom_id, "invalid_url", f"url {fields['url']!r} is not one run-batch serves: "
                                                 f"{', '.join(URLS)}")
    if fields["body"].get("stream") not in (None, False):
        return Refusal(custom_id, "stream_not_supported", "body.stream: a batch answers each request whole; leave "
                                                          "stream out, or false")
    return BatchRequest(custom_id, fields["url"], fields["body"])


async def answer(client: httpx.AsyncClient, request: BatchRequest | Refusal) -> dict[str, Any]:
    """The Batch output line for `request`: the app's answer to it, or the refusal."""
    if isinstance(request, Refusal):
        return batch_output(request.custom_id, error={"code": request.code, "message": request.message})
    response = await client.post(request.url, json=request.body)
    return batch_output(request.custom_id, response={
        "status_code": response.status_code, "request_id": response.headers["x-request-id"], "body": response.json()})


def batch_output(custom_id: str | None, response: dict[str, Any] | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
