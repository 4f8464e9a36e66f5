"""The scale-out ingress (`app/ingress.py`) without a cluster: a stand-in for the replicas' handle, so that what it
answers on its own (/health, the drain's 503s) and what it does with a request waiting for a replica when the
drain begins or ends can be set up exactly. Beside it, the single process's answers it must match."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.testclient import TestClient

pytest.importorskip("ray.serve")

from sluice.app.anthropic_errors import is_anthropic_path
from sluice.app.ingress import SluiceIngress
from sluice.app.replicas import ResponseStart
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState


def test_the_messages_api_is_its_path_and_every_path_under_it():
    assert is_anthropic_path("/v1/messages")
    assert is_anthropic_path("/v1/messages/count_tokens")
    assert is_anthropic_path("/v1/messages/")
    assert is_anthropic_path("/v1/messages/batches")
    assert not is_anthropic_path("/v1/messagesx")
    assert not is_anthropic_path("/v1/chat/completions")


def test_a_messages_path_sluice_does_not_serve_gets_anthropics_error_and_request_id():
    """The anthropic client reads both off its 404: the shape of the error and the `request-id` header."""
    client = TestClient(create_app(ServerState(ServerSettings(ui=False))))
    answer = client.post("/v1/messages/batches", json={})
    assert answer.status_code == 404 and answer.json()["type"] == "error"
    assert answer.headers["request-id"] == answer.headers["x-request-id"]
