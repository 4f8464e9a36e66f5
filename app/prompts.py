"""Turns request inputs into prompt token ids: completions' four prompt forms and chat messages."""

from __future__ import annotations

from dataclasses import dataclass

from model.tokenizer import ChatTemplateError, Tokenizer

from app.errors import invalid_request
from app.schemas import ChatMessage

# The model's chat templates know system/user/assistant; OpenAI's newer "developer" role means system.
_TEMPLATE_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Prompt:
    """One prompt's token ids; `text` is what `echo` repeats back."""

    token_ids: list[int]
    text: str


def completion_prompts(
    tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[Prompt]:
    """A string, a list of strings, a list of token ids or a list of such lists -> one `Prompt` each."""
    if isinstance(prompt, str):
        return [_from_text(tokenizer, prompt)]
    if all(isinstance(item, int) for item in prompt):
        return [_from_ids(tokenizer, prompt)]
    return [_from_text(tokenizer, item) if isinstance(item, str) else _from_ids(tokenizer, item) for item in prompt]


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True) -> Prompt:
    """The messages rendered with the model's chat template; a template that fails is the request's 400."""
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": _TEMPLATE_ROLE[m.role], "content": m.text()} for m in messages],
            add_generation_prompt=add_generation_prompt,
        )
    except ChatTemplateError as error:
        raise invalid_request(str(error), param="messages") from None
    return _from_text(tokenizer, rendered)


def _from_text(tokenizer: Tokenizer, text: str) -> Prompt:
    return Prompt(tokenizer.encode(text), text)


def _from_ids(tokenizer: Tokenizer, ids: list[int]) -> Prompt:
    return Prompt(list(ids), tokenizer.decode(ids))
