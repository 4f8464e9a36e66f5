"""Turns request inputs into prompt token ids: completions' four prompt forms and chat messages."""

from __future__ import annotations

from dataclasses import dataclass

from model.tokenizer import Tokenizer

from app.errors import invalid_request
from app.schemas import ChatMessage

# The model's chat templates know system/user/assistant; OpenAI's newer "developer" role means system.
_TEMPLATE_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Prompt:
    """One engine request's prompt; `text` is what `echo` repeats back."""

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
    rendered = tokenizer.apply_chat_template(
        [{"role": _TEMPLATE_ROLE[m.role], "content": m.text()} for m in messages],
        add_generation_prompt=add_generation_prompt,
    )
    return _from_text(tokenizer, rendered)


def check_fits(prompts: list[Prompt], max_tokens: int, max_model_len: int) -> None:
    for prompt in prompts:
        if len(prompt.token_ids) + max_tokens > max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{len(prompt.token_ids)} tokens and {max_tokens} more were requested",
                param="max_tokens",
            )


def _from_text(tokenizer: Tokenizer, text: str) -> Prompt:
    ids = tokenizer.encode(text)
    if not ids:
        raise invalid_request("prompt must not be empty", param="prompt")
    return Prompt(ids, text)


def _from_ids(tokenizer: Tokenizer, ids: list[int]) -> Prompt:
    check_token_ids(tokenizer, ids, param="prompt")
    return Prompt(list(ids), tokenizer.decode(ids))


def check_token_ids(tokenizer: Tokenizer, ids: list[int], param: str) -> None:
    bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if bad:
        raise invalid_request(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})", param=param)
