"""Chat messages -> prompt through the model's chat template (`app/prompts.py`), on SmolLM2's real tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from sluice.app.errors import APIError
from sluice.app.prompts import chat_prompt
from sluice.app.schemas import ChatCompletionRequest, ChatMessage
from sluice.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2) -> Tokenizer:
    return smollm2.tokenizer


def with_special(tokenizer: Tokenizer, **changes) -> Tokenizer:
    return Tokenizer.from_json(tokenizer.to_json(), replace(tokenizer.special, **changes))


def user(content) -> ChatMessage:
    return ChatMessage.model_validate({"role": "user", "content": content})


def test_chatml_gets_the_default_system_prompt_and_the_assistant_turn_to_write(tokenizer):
    assert chat_prompt(tokenizer, [user("Hi")]).text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_text_parts_are_one_content_joined_by_newlines(tokenizer):
    parts = chat_prompt(tokenizer, [user([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}])])
    assert parts == chat_prompt(tokenizer, [user("one\ntwo")])


def test_a_template_that_writes_bos_gets_no_second_one(tokenizer):
    adds_bos = with_special(tokenizer, add_bos=True, chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    assert chat_prompt(adds_bos, [user("Hi")]).token_ids == [tokenizer.bos_token_id, *tokenizer.encode("Hi")]


@pytest.mark.parametrize("template", ["{{ raise_exception('roles must alternate') }}",
                                      "{{ messages[0]['content'] + 1 }}"])
def test_a_template_that_fails_on_the_messages_is_a_400_on_messages(tokenizer, template):
    with pytest.raises(APIError) as raised:
        chat_prompt(with_special(tokenizer, chat_template=template), [user("Hi")])
    assert (raised.value.status, raised.value.param) == (400, "messages")
    assert raised.value.message.startswith("the chat template failed: ")


def chat(messages: list[dict], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def test_continue_final_message_ends_the_prompt_inside_the_assistants_text(tokenizer):
    request = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! I am"}],
                   add_generation_prompt=False, continue_final_message=True)
    opened = chat_prompt(tokenizer, request.messages, **request.rendering())
    answered = chat_prompt(tokenizer, [user("Hi")])
    assert opened.text == answered.text + "Hello! I am"  # no end of turn after it
    # A template that trims messages: the stripped text is the one it wrote.
    trims = with_special(tokenizer, chat_template="{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}")
    padded = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Sure, "}],
                  add_generation_prompt=False, continue_final_message=True)
    assert chat_prompt(trims, padded.messages, **padded.rendering()).text == "[Hi][Sure,"
    hides = with_special(tokenizer, chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(APIError) as raised:
        chat_prompt(hides, padded.messages, **padded.rendering())
    assert (raised.value.status, raised.value.param) == (400, "continue_final_message")


@pytest.mark.parametrize("fields, message", [
    ({"continue_final_message": True}, "cannot both be true"),
    ({"continue_final_message": True, "add_generation_prompt": False, "final": "user"}, "final assistant message"),
    ({"continue_final_message": True, "add_generation_prompt": False, "final": "  "}, "final assistant message"),
    ({"chat_template_kwargs": {"messages": []}}, "messages cannot be set here"),
    ({"chat_template_kwargs": {"namespace": 1, "tools": []}}, "namespace, tools cannot be set here"),
])
def test_rendering_fields_that_cannot_be_honoured_are_refused(fields, message):
    final = fields.pop("final", "Sure")
    last = {"role": "user", "content": "Hi"} if final == "user" else {"role": "assistant", "content": final}
    with pytest.raises(ValidationError, match=message):
        chat([{"role": "user", "content": "Hi"}, last], **fields)


def test_chat_template_kwargs_are_the_templates_variables(tokenizer):
    thinks = with_special(tokenizer, chat_template=(
        "{{ messages[0]['content'] }}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"))
    for kwargs, expected in (({}, "Hi"), ({"enable_thinking": False}, "Hi /no_think")):
        request = chat([{"role": "user", "content": "Hi"}], chat_template_kwargs=kwargs)
        assert chat_prompt(thinks, request.messages, **request.rendering()).text == expected
