"""How the generation routes read their sampling and request fields, as vLLM's OpenAI server reads the same body."""

from __future__ import annotations

import pytest

from sluice.app.schemas import ChatCompletionRequest, CompletionRequest

VOCAB = {"vocab_size": 1000}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("options", [{}, {"continuous_usage_stats": True}])
def test_stream_options_without_include_usage_include_usage_as_vllms_do(options):
    request = ChatCompletionRequest.model_validate({**CHAT, "stream": True, "stream_options": options}, context=VOCAB)
    assert request.include_usage and request.continuous_usage == bool(options)


def test_include_usage_false_leaves_usage_out_continuous_or_not():
    body = {"prompt": "hi", "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    request = CompletionRequest.model_validate(body, context=VOCAB)
    assert not request.include_usage and not request.continuous_usage
