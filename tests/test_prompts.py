"""Chat messages -> prompt through the model's chat template (`app/prompts.py`), on SmolLM2's real tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluice.app.errors import APIError
from sluice.app.prompts import chat_prompt
from sluice.app.schemas import ChatMessage
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
