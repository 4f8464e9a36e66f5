"""Per-request generation parameters (the engine's side of an OpenAI request)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    import numpy as np

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias


class RequestRejected(ValueError):
    """The request can never run here (too long for the model or the KV pool, an empty prompt, a grammar that
    does not compile, ...). `param`: the field at fault, by SamplingParams' name, or "prompt" for the prompt (which
    each API names its own way), or None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(RequestRejected):
    """A prompt, with the tokens asked for after it, is longer than the model's context or the KV pool (OpenAI's
    `context_length_exceeded`, which clients and agent SDKs read to shorten a conversation)."""

    def __init__(self, message: str):
        super().__init__(message, "prompt")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output text must follow, as the request gave it (compiled by `batching/structured.py`).

    kind "json_schema": `source` is the schema as JSON text; "regex": a regular expression the whole output
    matches; "choice": a JSON list of the strings the output may be; "grammar": a Lark (or llama.cpp GBNF)
    grammar.
    `preamble`, when set: a Lark grammar (llguidance's) for the rule `preamble`, what the output starts with before
    it follows `source` (a reasoning model's thinking, `app/reasoning.py`). `mostly_free`: the grammar leaves most
    of the output free text and seldom forces a token (tool_choice auto's calls), so steps overlap over it as over
    an unconstrained sequence's (`Engine._overlaps`).
    """

    kind: Literal["json_schema", "regex", "choice", "grammar"]
    source: str
    preamble: str | None = None
    mostly_free: bool = False


@dataclass(frozen=True)
class LoraRequest:
    """A LoRA adapter a request runs with, as the engine holds it (`Engine.adapters`): its served `name`, its
    `fingerprint`, the hash of its files (the two are the adapter: `batching.lora_slots`), the `folder` they were read
    from (a Hub id's snapshot), and its `weights`, one slot's (`model.lora.slot_weights`), the host copy written into
    a device slot to run it: emptied while host memory does not hold it (--max-cpu-loras: `LoraSlots.hold`), filled
    again from `folder`, off the engine thread, when a slot needs it (`LoraSlots.find`)."""

    name: str
    fingerprint: str
    folder: str = field(default="", compare=False)
    weights: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)


class CacheNamespace(NamedTuple):
    """A request's part of the prefix cache: its `cache_salt` and its LoRA adapter's fingerprint, either None. Kept
    apart, not joined into one string: a salt, any string a client sends, must never name an adapter's pages."""

    salt: str | None
    adapter: str | None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for every choice of one request.

    Values are trusted: the HTTP edge (`app/schemas.py`) checks every range once; what needs the model
    (context length, pool size) is checked by `Engine.add_request`.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    `seed` makes the request's samples reproducible whatever else shares its batch.
    `logprobs` asks for the chosen token's log-probability; `top_logprobs` (0..20) for the k best.
    `n` samples per prompt; `priority`: lower runs first.
    `include_stop_str_in_output` (vLLM's): the stop string, or stop id's text, that ended the output stays in it.
    `logit_bias`: (token id, bias) pairs, each bias (-100..100) added to that token's logit before sampling.
    `allowed_token_ids` (vLLM's), when set: the only ids it may sample (up to MAX_LOGIT_BIAS, in the same columns).
    `skip_special_tokens` False keeps special tokens' text in the output text (vLLM's extension; what a reasoning
    reader needs when `<think>` is a special token); `kept_special_ids`: special tokens whose text is kept all the
    same (what a tool-call reader needs when the format's tags are special tokens); host-only, like `stop`: they
    pick the detokenizer.
    `structured`: a grammar the output must follow (EOS then ends it only where the grammar is complete).
    `pooling` makes it an embedding request (max_tokens 0): each prompt is prefilled, never sampled, and ends with
    the sum of its final hidden states ("last": its last token's, "mean": all its tokens') in `Increment.embedding`.
    `prompt_logprobs` (0..20): each prompt token's log-probability after the tokens before it, with that many best
    alternatives (`Increment.prompt_logprobs`); scored while prefilling, so such a sequence reads nothing from the
    prefix cache.
    `cache_salt` (vLLM's): the prefix cache (pool and persistent store) is shared only among requests with the same
    salt, so one tenant cannot learn from time to first token which prompts another sent.
    `lora`: the LoRA adapter the model runs with (None: the base model), chosen by the request's `model` name.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    kept_special_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    priority: int = 0
    structured: StructuredOutput | None = None
    pooling: Literal["last", "mean"] | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    lora: LoraRequest | None = None

    def allows(self, token: int) -> bool:
        """Whether `allowed_token_ids` lets it sample `token` (any token where it is not set)."""
        return not self.allowed_token_ids or token in self.allowed_token_ids

    @cached_property
    def biased_ids(self) -> tuple[tuple[int, float], ...]:
        """The (id, bias) pairs the sampler's bias columns hold: the allowed ids, with their logit_bias, when some
        are; else the logit_bias."""
        if not self.allowed_token_ids:
            return self.logit_bias
        bias = dict(self.logit_bias)
        return tuple((token, bias.get(token, 0.0)) for token in self.allowed_token_ids)

    @cached_property  # read per sequence and step: kept after the first read (in the instance's __dict__)
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @cached_property
    def cache_namespace(self) -> CacheNamespace | None:
        """What the prefix cache keys pages under beside their tokens (None: the shared namespace): the
        `cache_salt`, and the adapter's fingerprint, as the K/V an adapter computes are its own."""
        if self.cache_salt is None and self.lora is None:
            return None
        return CacheNamespace(self.cache_salt, self.lora.fingerprint if self.lora is not None else None)

    @cached_property
    def reads_history(self) -> bool:
        """Whether the penalties need the sequence's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
