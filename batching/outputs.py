"""What the engine hands back for a request: per-choice increments, usage, and the collectors that receive them.

A request has `len(prompts) * n` choices (choice `prompt * n + sample`). The engine thread never calls into a
consumer directly: each step it gathers every request's increments and gives them to its driver in one batch
(`Deliveries`); the async driver passes that batch to the event loop in one `call_soon_threadsafe`, where each
request's `Collector` receives its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import numpy as np

FinishReason = Literal["stop", "length", "abort", "error"]


class TokenLogprob(NamedTuple):
    """Log-probability of one sampled token, with the `top_logprobs` best alternatives (best first); a prompt
    token's (`Increment.prompt_logprobs`) has its `rank` in the vocabulary too (1: the most likely)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Usage:
    """Token counts of a whole request: prompts counted once each (not once per sample), outputs of every choice."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Increment(NamedTuple):
    """What one choice produced since its previous increment (a tuple: the engine builds one per sequence and
    step, and a frozen dataclass costs 3x as much to build).

    `finish_reason` is set on the choice's last increment; `error` carries a message when it failed in the
    engine; `usage` is set on the request's very last increment (when every choice has finished); `embedding`
    ([hidden] float32, `SamplingParams.pooling`) on an embedding's only increment. `stop_reason` (vLLM's), on a
    choice that finished with "stop": the stop string or the request's stop token id that ended it (None for EOS).
    `prompt_logprobs` (`SamplingParams.prompt_logprobs`), on a choice's first increment: its prompt tokens'
    logprobs, None for the first token.
    """

    choice: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    embedding: np.ndarray | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputSink(Protocol):
    """Receives one request's increments, in order, on the consumer's side of the engine."""

    def put(self, increment: Increment) -> None: ...


Deliveries = list[tuple[OutputSink, Increment]]


def deliver(deliveries: Deliveries) -> None:
    for sink, increment in deliveries:
        sink.put(increment)


class Collector:
    """The async consumer of one request: `async for increment in collector` until every choice has finished.

    Lives on the event loop; `put` is called there (by the engine's driver), never from the engine thread.
    Increments not yet taken are kept per choice and joined into one when taken, so a consumer that stops
    taking them (a stalled reader) holds what its request generates, at most `max_tokens` per choice.
    """

    def __init__(self, request_id: str, num_choices: int) -> None:
        self.request_id = request_id
        self.num_choices = num_choices
        self.num_finished = 0
        self.usage: Usage | None = None
        self._pending: dict[int, list[Increment]] = {}
        self._wakeup = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.num_finished == self.num_choices

    def put(self, increment: Increment) -> None:
        # Moved to the end, so the request's last increment (the one with its usage) is taken last.
        parts = self._pending.pop(increment.choice, [])
        parts.append(increment)
        self._pending[increment.choice] = [joined(parts)] if len(parts) >= 64 else parts
        self._wakeup.set()

    async def __aiter__(self) -> AsyncIterator[Increment]:
        while not self.finished:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            increment = joined(self._pending.pop(next(iter(self._pending))))
            if increment.finished:
                self.num_finished += 1
                self.usage = increment.usage or self.usage
            yield increment


def joined(parts: list[Increment]) -> Increment:
    """One choice's consecutive increments as one (the first one's prompt logprobs, the last one's finish, error
    and usage)."""
    if len(parts) == 1:
        return parts[0]
    return parts[-1]._replace(text="".join(p.text for p in parts),
                              token_ids=tuple(t for p in parts for t in p.token_ids),
                              logprobs=tuple(lp for p in parts for lp in p.logprobs),
                              prompt_logprobs=parts[0].prompt_logprobs)


@dataclass(frozen=True)
class Completion:
    """One choice's whole output, joined from its increments (offline `Engine.generate`)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason | None
    usage: Usage | None
    error: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class ListCollector:
    """The offline consumer: keeps one request's increments and joins them per choice."""

    def __init__(self, num_choices: int) -> None:
        self._by_choice: list[list[Increment]] = [[] for _ in range(num_choices)]
        self._usage: Usage | None = None

    def put(self, increment: Increment) -> None:
        self._by_choice[increment.choice].append(increment)
        self._usage = increment.usage or self._usage

    def completions(self) -> list[Completion]:
        wholes = [joined(parts) if parts else Increment(choice, "", ()) for choice, parts in enumerate(self._by_choice)]
        return [Completion(whole.text, whole.token_ids, whole.logprobs, whole.finish_reason, self._usage, whole.error,
                           whole.stop_reason, whole.prompt_logprobs) for whole in wholes]
