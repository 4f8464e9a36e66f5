"""How the generation routes read their sampling and request fields, as vLLM's OpenAI server reads the same body."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sluice.app.errors import from_validation_error
from sluice.app.schemas import ChatCompletionRequest, CompletionRequest

VOCAB = {"vocab_size": 1000}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("options", [{}, {"continuous_usage_stats": True}])
def test_stream_options_without_include_usage_include_usage_as_vllms_do(options):
    request = ChatCompletionRequest.model_validate({**CHAT, "stream": True, "stream_options": options}, context=VOCAB)
    assert request.include_usage and request.continuous_usage == bool(options)


@pytest.mark.parametrize("include_usage", [False, None])
def test_include_usage_false_or_null_leaves_usage_out_continuous_or_not(include_usage):
    """A null is false to OpenAI and to vLLM (`bool(include_usage)`): true is the default of a stream_options
    without the key, not of a null."""
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    body = {"prompt": "hi", "stream": True, "stream_options": options}
    request = CompletionRequest.model_validate(body, context=VOCAB)
    assert not request.include_usage and not request.continuous_usage


@pytest.mark.parametrize(("prompt", "param", "words"), [
    ([-1], "prompt.0", "greater than or equal to 0"), ([5, 1.5], "prompt.1", "valid integer"),
    ([[1, -2]], "prompt.0.1", "greater than or equal to 0"), (["a", 1], "prompt.1", "valid string"),
    ([[1], "a"], "prompt.1", "valid list"), (5, "prompt", "a list of lists of token ids"),
])
def test_a_prompt_off_its_form_is_refused_for_what_is_wrong_in_it_not_as_no_string(prompt, param, words):
    """Every one was "prompt: Input should be a valid string", the complaint of the union's first member."""
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": prompt}, context=VOCAB)
    error = from_validation_error(caught.value, {"prompt": prompt})
    assert error.param == param and words in error.message
