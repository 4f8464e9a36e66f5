"""The engine's `TokenLogprob`s in the two OpenAI shapes (legacy completions and chat)."""

from __future__ import annotations

from collections.abc import Sequence

from batching.request_output import TokenLogprob
from model.tokenizer import Tokenizer

from app.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprobInfo, TopLogprob


def completion_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprob], text_offset: int
) -> CompletionLogprobs:
    """Completions' shape; `text_offset` is where the first token's text starts in the choice's text.

    As in OpenAI's API, each `top_logprobs` dict holds the k best tokens and the sampled one.
    """
    tokens, offsets = [], []
    for entry in entries:
        text = tokenizer.token_text(entry.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    top = [
        {tokenizer.token_text(token_id): logprob for token_id, logprob in (*entry.top, (entry.token_id, entry.logprob))}
        for entry in entries
    ]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[entry.logprob for entry in entries], top_logprobs=top, text_offset=offsets
    )


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprobInfo(
                **_top(tokenizer, entry.token_id, entry.logprob).model_dump(),
                top_logprobs=[_top(tokenizer, token_id, logprob) for token_id, logprob in entry.top],
            )
            for entry in entries
        ]
    )


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
