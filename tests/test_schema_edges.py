"""Request fields at the edges of what OpenAI's and vLLM's APIs take: a JSON boolean is no number and nothing else is
a boolean, and a null stream option is its default."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from sluice.app.anthropic_schemas import MessagesRequest
from sluice.app.errors import APIError, from_validation_error
from sluice.app.responses_api_schemas import RetrieveQuery
from sluice.app.routes import parse_query
from sluice.app.schemas import ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4096}


def parsed(schema: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    """`body` checked as `routes.parse_body` checks it."""
    return schema.model_validate(body, context={"vocab_size": 1000})


@pytest.mark.parametrize(("schema", "body", "param", "expected"), [
    (ChatCompletionRequest, {**CHAT, "max_tokens": True}, "max_tokens", "an integer"),
    (ChatCompletionRequest, {**CHAT, "temperature": False}, "temperature", "a number"),
    (ChatCompletionRequest, {**CHAT, "n": True}, "n", "an integer"),
    (CompletionRequest, {"prompt": "hi", "logprobs": True}, "logprobs", "an integer"),
    (MessagesRequest, {**MESSAGES, "max_tokens": True}, "max_tokens", "an integer"),
    (MessagesRequest, {**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": True}},
     "thinking.budget_tokens", "an integer"),
    (ChatCompletionRequest, {**CHAT, "logit_bias": {"5": 2.5, "7": True}}, "logit_bias.7", "a number"),
    (CompletionRequest, {"prompt": "hi", "logit_bias": {"5": False}}, "logit_bias.5", "a number"),
])
def test_a_boolean_for_a_number_is_a_400_naming_the_field(schema, body, param, expected):
    with pytest.raises(ValidationError) as caught:
        parsed(schema, body)
    error = from_validation_error(caught.value, body)
    assert (error.status, error.param) == (400, param)
    assert error.message == f"{param}: expected {expected}, but got a boolean instead"


@pytest.mark.parametrize(("schema", "body", "param", "got"), [
    (ChatCompletionRequest, {**CHAT, "stream": "yes"}, "stream", "a string"),
    (ChatCompletionRequest, {**CHAT, "logprobs": 1}, "logprobs", "an integer"),
    (CompletionRequest, {"prompt": "hi", "echo": "false"}, "echo", "a string"),
    (MessagesRequest, {**MESSAGES, "stream": 0}, "stream", "an integer"),
])
def test_anything_but_a_boolean_for_a_boolean_is_a_400_naming_the_field(schema, body, param, got):
    """Lax validation would read "yes", "false" or 1 as booleans ("false" as false); OpenAI's API refuses them."""
    with pytest.raises(ValidationError) as caught:
        parsed(schema, body)
    error = from_validation_error(caught.value, body)
    assert (error.status, error.param) == (400, param)
    assert error.message == f"{param}: expected a boolean, but got {got} instead"


@pytest.mark.parametrize(("query", "stream"), [(b"stream=true", True), (b"stream=false", False), (b"stream=1", True),
                                             (b"", False), (b"stream=maybe", None)])
def test_a_query_strings_boolean_is_a_word(query, stream):
    """As the openai client writes `responses.retrieve(id, stream=True)`; a body's booleans stay JSON's."""
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": query})
    if stream is None:
        with pytest.raises(APIError) as refused:
            parse_query(request, RetrieveQuery)
        assert (refused.value.status, refused.value.param) == (400, "stream")
    else:
        assert parse_query(request, RetrieveQuery).stream is stream


def test_numbers_still_take_whole_numbers_and_booleans_stay_booleans():
    body = parsed(ChatCompletionRequest, {**CHAT, "temperature": 1, "max_tokens": 5.0, "n": 2, "logprobs": True,
                                          "logit_bias": {"5": -100, "7": 2.5}})
    assert (body.temperature, body.max_tokens, body.n, body.logprobs) == (1.0, 5, 2, True)
    assert body.logit_bias == {"5": -100.0, "7": 2.5}


def test_null_stream_options_are_false_as_openai_and_vllm_take_them():
    # vLLM reads `stream_options.include_usage` as it comes (None: no usage); true is only the default of a
    # stream_options without the key.
    body = parsed(ChatCompletionRequest, {**CHAT, "stream": True,
                                          "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
    assert not body.include_usage and not body.continuous_usage
    assert parsed(ChatCompletionRequest, {**CHAT, "stream": True, "stream_options": {}}).include_usage
