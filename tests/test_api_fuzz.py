"""Schemathesis against a live `sluice serve`'s own /openapi.json: generated requests, valid and invalid, to
every route; no answer may be a 5xx, and every answer must match the documented statuses, media types and
schemas. The server runs a tiny random model (with a ChatML template) so that each generation is cheap, with runtime
LoRA updating on, so that its two routes are fuzzed too (the other routes serve as without it: no adapter is ever
loaded, see `nowhere`)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from sluice.app.openapi import path_template
from sluice.app.server import CONVERSATION, LORA_ADMIN_ROUTES, ROUTES
from sluice.model.config import ModelConfig

from conftest import home_with_built_kernels
from hf_folder import CHATML, write_hf_folder
from test_api_e2e import start_server

# The roofline's peaks declared, not measured at start-up (the dashboard's routes answer as with measured ones).
FLAGS = ["--skip-server-warmup", "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--kv-cache-memory", "8MiB", "--max-waiting", "64", "--served-model-name", "tiny",
         "--peak-gflops", "1", "--peak-bandwidth-gbs", "1", "--allow-runtime-lora-updating"]
EXAMPLES_PER_ROUTE = 25
LOAD = "/v1/load_lora_adapter"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz") / "tiny"
    write_hf_folder(folder, ModelConfig.tiny(), seed=5, chat_template=CHATML)
    home = home_with_built_kernels(tmp_path_factory.mktemp("home"))
    proc = start_server("--model", str(folder), *FLAGS, env={"SLUICE_HOME": str(home)})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def seeded(server) -> dict[str, str]:
    """The path parameters of a conversation with items, made once for the module: the routes that read one (and
    change its metadata or add to it) then answer 200 too, not only a random id's 404, and those answers are
    checked against their schemas."""
    created = httpx.post(f"{server.url}/v1/conversations", json={"items": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}]}).json()
    items = httpx.get(f"{server.url}/v1/conversations/{created['id']}/items").json()["data"]
    return {"conversation_id": created["id"], "item_id": items[-1]["id"]}


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


# (Schemathesis's own pytest parametrization does not run under pytest 9; hypothesis drives each operation.)
# Valid requests everywhere; valid ones forced to stream where a route streams (the generator seldom sets
# `stream` itself, in a body or a query); invalid ones where there is a body or a query to break.
OPERATIONS = [op for _, op in ROUTES + LORA_ADMIN_ROUTES]
CASES = [("valid", op.method, path_template(op.path)) for op in OPERATIONS]
CASES += [("streamed", op.method, path_template(op.path)) for op in OPERATIONS if op.stream_chunk is not None]
CASES += [("invalid", op.method, path_template(op.path)) for op in OPERATIONS
          if op.request is not None or op.query is not None]


@pytest.fixture(scope="module")
def missing(tmp_path_factory):
    """A folder that does not exist: nothing lies under it, whatever follows (".." included)."""
    return tmp_path_factory.mktemp("lora") / "missing"


def nowhere(case, missing):
    """`case` with a load's `lora_path` moved under `missing`, as a relative path (an absolute one would replace it):
    a generated path ("/", ".", "ORG/NAME", an existing folder) must never load anything nor ask the Hub, while its
    characters and length still reach the server's path handling (answered 400 or 404, never 5xx)."""
    if isinstance(case.body, dict) and isinstance(case.body.get("lora_path"), str) and case.body["lora_path"]:
        case.body["lora_path"] = str(missing / case.body["lora_path"].lstrip("/"))
    return case


def streamed(case):
    if isinstance(case.body, dict):
        case.body["stream"] = True
    elif case.method == "GET":
        case.query = {**(case.query or {}), "stream": "true"}
    return case


def on_seeded(case, seeded: dict[str, str]):
    """`case` on the seeded conversation (and its item), where its path names them."""
    case.path_parameters = {**(case.path_parameters or {}),
                            **{name: value for name, value in seeded.items() if name in case.path_parameters}}
    return case


def strategy(api, method: str, path: str, kind: str, missing, seeded):
    operation = api[path][method]
    if kind == "invalid":
        cases = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    else:
        valid = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
        cases = valid.map(streamed) if kind == "streamed" else valid
    if path.startswith(CONVERSATION) and method != "DELETE":  # deleting would leave the others a 404
        cases = cases.map(lambda case: on_seeded(case, seeded))
    return cases.map(lambda case: nowhere(case, missing)) if path == LOAD else cases


@pytest.mark.parametrize(("kind", "method", "path"), CASES, ids=[f"{k}-{p}" for k, _, p in CASES])
def test_no_generated_request_gets_a_5xx_or_an_undocumented_answer(api, server, missing, seeded, kind, method,
                                                                  path):
    @given(case=strategy(api, method, path, kind, missing, seeded))
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    def check(case):
        case.call_and_validate(
            base_url=server.url, timeout=120,
            checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                    response_schema_conformance],
        )

    check()
