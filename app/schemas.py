"""Pydantic models of the OpenAI request and response bodies Sluice speaks: the one place inputs are checked.

Every request field is checked here, types and ranges, including what depends on the served vocabulary
(token ids, given through the validation context `{"vocab_size": V}`); anything rejected becomes a 400 naming
the field. Fields that would change the output but are not implemented are rejected by name rather than
ignored. Unknown fields are ignored, as OpenAI-compatible servers do for load generators' extras. Responses and
stream chunks use the same models, serialized in the OpenAI field order; `/openapi.json` is built from them.
"""

from __future__ import annotations

import dataclasses
import json
from abc import abstractmethod
from collections.abc import Mapping
from datetime import datetime, timezone
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, ValidationInfo, \
    field_serializer, field_validator, model_serializer, model_validator
from pydantic_core import InitErrorDetails

from sluice.batching.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams, StructuredOutput
from sluice.app.tool_call_streams import not_json
from sluice.model.tokenizer import TEMPLATE_VARIABLES

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 16
MAX_PROMPTS = 256
MAX_SAMPLES = 64

# How much a reasoning model is to think: OpenAI's levels (and vLLM's).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
TokenId = Annotated[int, Field(ge=0, strict=True)]  # strict: `true` or "5" is no token id
# logit_bias's keys: token ids written as JSON object keys.
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]


def _check_vocabulary(ids: list[int], info: ValidationInfo) -> list[int]:
    vocab_size = (info.context or {}).get("vocab_size")
    if vocab_size is not None:
        bad = next((i for i in ids if i >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def field_error(field: str, message: str, value: Any) -> ValidationError:
    """A cross-field check's complaint about `field` (holding `value`), located there so that its 400 names it as
    `param`, as OpenAI's do: a model validator's ValueError has no location (`param` null). Its context names the
    field, which the body may lack (`errors.from_validation_error`)."""
    details = InitErrorDetails(type="value_error", loc=(field,), input=value,
                               ctx={"error": ValueError(message), "field": field})
    return ValidationError.from_exception_data("request", [details])


def text_parts_only(*types: str):
    """A before-validator of a `str | list[<text part>]` content field: a part of another type (an image, audio, a
    file) is refused by its type, not by the union's failed branches ("content.str: Input should be a valid
    string")."""

    def check(value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in types:
                raise ValueError(f"content parts of type {kind!r} are not supported: the model reads text only")
        return value

    return check


def named_function_choice(shape: str, name_key: str):
    """A before-validator of a `"none" | "auto" | "required" | <named function> | <allowed tools>` tool_choice field:
    an object of another type (a hosted tool, a custom one) or a function's without `name_key` is refused by what it
    is, not by the union's failed branches ("tool_choice.str: Input should be a valid string"). `shape`: the named
    choice as the API writes it."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") not in ("function", "allowed_tools"):
            raise ValueError(f"tool_choice of type {value.get('type')!r} is not supported: give none, auto, "
                             f"required, {shape} or allowed_tools")
        if isinstance(value, dict) and value["type"] == "function" and name_key not in value:
            raise ValueError(f"a named tool_choice is {shape}")
        return value

    return check


# --- requests ---------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Some clients send `"temperature": null` for "not set"; treat it as omitted.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="before")
    @classmethod
    def _booleans_apart_from_numbers(cls, data: Any) -> Any:
        # Lax mode reads `true` as 1 (`"max_tokens": true`, a logit_bias of `true`), and "yes", "on", 1 or "false"
        # as booleans (`"stream": "yes"`); OpenAI's API refuses either.
        for name, value in data.items() if isinstance(data, dict) else ():
            if name not in cls.model_fields:
                continue
            annotation = cls.model_fields[name].annotation
            if isinstance(value, bool) and (expected := _number_expected(annotation)) is not None:
                raise field_error(name, f"expected {expected}, but got a boolean instead", value)
            if value is not None and not isinstance(value, bool) and takes_only_booleans(annotation):
                raise field_error(name, f"expected a boolean, but got {_json_type(value)} instead", value)
            if isinstance(value, dict) and (expected := _number_expected(_values_of(annotation))) is not None:
                for key, item in value.items():
                    if isinstance(item, bool):
                        raise field_error(f"{name}.{key}", f"expected {expected}, but got a boolean instead", item)
        return data


def _options(annotation: Any) -> tuple[Any, ...]:
    """The types a field of `annotation` takes: a union's members, else the type alone."""
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


def _values_of(annotation: Any) -> Any:
    """The value type of a `dict[K, V]` field (or `dict[K, V] | None`), its constraints aside; else None."""
    for option in _options(annotation):
        if get_origin(option) is dict:
            value = get_args(option)[1]
            return get_args(value)[0] if get_origin(value) is Annotated else value
    return None


def takes_only_booleans(annotation: Any) -> bool:
    """Whether a field of `annotation` takes a boolean and nothing else (None aside)."""
    types = set(_options(annotation)) - {type(None)}
    return types == {bool}


def _json_type(value: Any) -> str:
    """What OpenAI's errors call a JSON value's type: "a string", "an integer", "a decimal", "an object"..."""
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int):
        return "an integer"
    return "a decimal" if isinstance(value, float) else "an array" if isinstance(value, list) else "an object"


def _number_expected(annotation: Any) -> str | None:
    """What a field of `annotation` takes where it takes a number and no boolean ("an integer", "a number"), else
    None."""
    types = _options(annotation)
    if bool in types:
        return None
    return "an integer" if int in types else "a number" if float in types else None


class StreamOptions(_Request):
    include_usage: bool = Field(True, description="true unless set false, as vLLM's: stream_options given without "
                                "it (continuous_usage_stats alone, say) still asks for usage")
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk has its choice's "
                                         "usage so far too (its prompt's tokens and the tokens it has generated)")

    @model_validator(mode="before")
    @classmethod
    def _null_usage_is_false(cls, data: Any) -> Any:
        # A null include_usage is false to OpenAI and to vLLM (`bool(include_usage)`): true is the default of a
        # stream_options without the key, not of a null, which `_null_means_default` would read as left out.
        if isinstance(data, dict) and "include_usage" in data and data["include_usage"] is None:
            return {**data, "include_usage": False}
        return data


# --- structured output: OpenAI's response_format and vLLM's structured_outputs ---------------------------
# What the grammars say is checked when the engine compiles them, against the model's vocabulary (a 400 too).


class JsonSchemaSpec(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(None, description="ignored: the schema is always enforced")


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
ANY_JSON_OBJECT = {"type": "object"}


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one constraint. Unknown keys are refused: each would change the
    output."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema, or its JSON text")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="a Lark grammar (llama.cpp GBNF is accepted too)")
    json_object: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        if len(self._given()) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self

    def _given(self) -> list[str]:
        """The keys the request set (json_object false sets none), as it wrote them."""
        return [field.alias or name for name, field in type(self).model_fields.items()
                if getattr(self, name) not in (None, False)]

    def key(self) -> str:
        """The key that holds the constraint (`regex`, ...)."""
        return self._given()[0]

    def constraint(self) -> StructuredOutput:
        if self.json_ is not None:
            source = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput("json_schema", source)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        return StructuredOutput("json_schema", json.dumps(ANY_JSON_OBJECT))


# vLLM's older names for structured_outputs' keys: refused by name rather than ignored.
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object")
_ANY = object()
# vLLM's fields that would change the output and are not implemented here: refused by name rather than ignored,
# unless null or set to what they do by default (`_ANY`: every value).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    **dict.fromkeys(_GUIDED_FIELDS, _ANY), "bad_words": [],
    "use_beam_search": False, "length_penalty": 1.0,
}
MODERATION_HINT = ": no moderation model runs here"
# What a refusal of a field adds after "<field> is not supported".
_UNSUPPORTED_HINTS = {**dict.fromkeys(_GUIDED_FIELDS, "; use structured_outputs"),
                      **dict.fromkeys(("modalities", "audio"), ": the model writes text only"),
                      "moderation": MODERATION_HINT}


class PromptTruncation(_Request):
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="vLLM's extension: keep only each prompt's "
                                               "last k tokens (-1: as many as the context holds), k >= 1")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_a_token(cls, value: int) -> int:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1, or -1")
        return value


class SamplingRequest(PromptTruncation):
    """Fields shared by /v1/completions and /v1/chat/completions.

    A field named like a `SamplingParams` field reaches the engine as it is (`sampling_params`).
    """

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="-1 or 0: no top-k filter; beyond the vocabulary: no filter either")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64,
                             description="OpenAI's signed 64-bit range, or an unsigned 64-bit seed")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    best_of: int | None = Field(None, ge=1, description="only best_of == n is supported")
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description="vLLM's extension: false keeps special tokens' text in "
                                                        "the output")
    include_stop_str_in_output: bool = Field(False, description="vLLM's extension: the stop string (or stop token "
                                                                "id's text) that ended the output stays in it")
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="vLLM's extension: a lower value is scheduled "
                                                            "first (then arrival order)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="vLLM's extension: each prompt "
                                        "token's logprob and rank, with this many best alternatives (not streamed)")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM's extension: logprobs name tokens "
                                                                "\"token_id:{id}\" instead of by their text")
    return_token_ids: bool = Field(False, description="vLLM's extension: the response has the prompt's token ids "
                                   "and each choice's (streamed: the prompt's on the first chunk, each chunk its "
                                   "new ones)")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM's extension: the prefix cache is shared only "
                                   "among requests with the same salt (one tenant's prompts stay unguessable to "
                                   "another from its time to first token)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id -> bias added to its logit before sampling")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_LOGIT_BIAS,
                                                    description="vLLM's extension: the only ids that may be sampled")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    unsupported: ClassVar[dict[str, Any]] = UNSUPPORTED_FIELDS
    _check_stop_token_ids = field_validator("stop_token_ids", "allowed_token_ids")(_check_vocabulary)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: str | list[str]) -> str | list[str]:
        # "" matches at once: honoured, it would end every reply after its first token.
        if "" in ([value] if isinstance(value, str) else value):
            raise ValueError("stop must not contain an empty string")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int, info: ValidationInfo) -> int:
        if value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_in_vocabulary(cls, value: dict[str, float] | None, info: ValidationInfo
                                  ) -> dict[str, float] | None:
        if value:
            _check_vocabulary([int(key) for key in value], info)
        return value

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, default in cls.unsupported.items():
            if data.get(name) is not None and (default is _ANY or data[name] != default):
                raise field_error(name, f"{name} is not supported{_UNSUPPORTED_HINTS.get(name, '')}", data[name])
        return data

    @model_validator(mode="after")
    def _cross_field_rules(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true",
                              self.stream_options)
        if self.prompt_logprobs is not None and self.stream:
            raise field_error("prompt_logprobs", "prompt_logprobs are not available when stream is true",
                              self.prompt_logprobs)
        json_format = isinstance(self.response_format, (JsonObjectFormat, JsonSchemaFormat))
        if self.structured_outputs is not None and json_format:
            raise field_error("structured_outputs", "give response_format or structured_outputs, not both",
                              self.structured_outputs)
        if self.structured_outputs is not None or json_format:
            self._no_ending_forced("structured output")
        if (self.structured_outputs is not None or json_format) and self.allowed_token_ids:
            raise field_error("allowed_token_ids", "allowed_token_ids cannot be combined with structured output: the "
                              "grammar decides which tokens are allowed", self.allowed_token_ids)
        return self

    def _no_ending_forced(self, grammar: str) -> None:
        """ignore_eos and min_tokens refused beside `grammar`, which decides where the output ends."""
        if self.ignore_eos or self.min_tokens:
            field = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise field_error(field, f"ignore_eos and min_tokens cannot be combined with {grammar}: the grammar "
                              "decides where the output ends", getattr(self, field))

    def structured(self) -> StructuredOutput | None:
        """The grammar the output must follow, if the request asks for one."""
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        schema = self.response_schema()
        return None if schema is None else StructuredOutput("json_schema", json.dumps(schema))

    def response_schema(self) -> dict[str, Any] | None:
        """The JSON schema response_format holds the answer to (json_object: any object), if it does."""
        if isinstance(self.response_format, JsonSchemaFormat):
            return self.response_format.json_schema.schema_
        return dict(ANY_JSON_OBJECT) if isinstance(self.response_format, JsonObjectFormat) else None

    def grammar_field(self) -> str | None:
        """Where the request holds the grammar `structured` reads (`response_format.json_schema.schema`,
        `structured_outputs.regex`): the field a grammar that does not compile is refused for."""
        if self.structured_outputs is not None:
            return f"structured_outputs.{self.structured_outputs.key()}"
        if isinstance(self.response_format, JsonSchemaFormat):
            return "response_format.json_schema.schema"
        if isinstance(self.response_format, JsonObjectFormat):
            return "response_format"
        return None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, default_max_tokens: int | None = None,
                        model_defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """The engine's parameters; `default_max_tokens` applies when the request sets no limit (only a chat request
        can: a completion's field has the API's default), and `model_defaults` (the model's own,
        `model/generation_config.py`) to the fields it leaves out, its limit of tokens as a bound on
        `default_max_tokens`."""
        model_defaults = model_defaults or {}
        names = (f.name for f in dataclasses.fields(SamplingParams))
        shared = {name: getattr(self, name) for name in names if name in type(self).model_fields}
        shared |= {name: value for name, value in model_defaults.items()
                   if name in shared and name not in self.model_fields_set}
        max_tokens = self.max_new_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens, model_defaults.get("max_tokens", default_max_tokens))
        return SamplingParams(**{
            **shared,
            "max_tokens": max_tokens,
            "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop),
            "stop_token_ids": tuple(self.stop_token_ids),
            "logit_bias": tuple(sorted({int(key): bias for key, bias in (self.logit_bias or {}).items()}.items())),
            "allowed_token_ids": tuple(dict.fromkeys(self.allowed_token_ids or ())),
            "structured": self.structured(),
            **self._logprob_params(),
        })

    @abstractmethod
    def _logprob_params(self) -> dict[str, Any]:
        """`logprobs` and `top_logprobs` for the engine: each API asks for them in its own shape."""


def _prompt_form(value: Any) -> str | None:
    """Which of a prompt's four forms `value` is written in, read from its type (a list's from its first item), so
    that one off its form is refused for what is wrong in it (`prompt.0`: a token id below 0), not by the union's
    first member ("Input should be a valid string"); None for a value of no form."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"


Prompt = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[TokenId], Tag("ids")] | Annotated[list[str], Tag("texts")]
    | Annotated[list[list[TokenId]], Tag("id_lists")],
    Discriminator(_prompt_form, custom_error_type="prompt_form", custom_error_message="Input should be a string, a "
                  "list of strings, a list of token ids or a list of lists of token ids"),
]


def check_prompts(prompt: Prompt, info: ValidationInfo, max_prompts: int = MAX_PROMPTS) -> Prompt:
    """A field of prompts (`prompt`, embeddings' `input`): none empty, at most `max_prompts`, ids in the
    vocabulary."""
    if not prompt:
        raise ValueError(f"{info.field_name} must not be empty")
    single = isinstance(prompt, str) or isinstance(prompt[0], int)
    prompts = [prompt] if single else prompt
    if (empty := next((i for i, p in enumerate(prompts) if not p), None)) is not None:
        raise ValueError(f"{info.field_name}{'' if single else f'[{empty}]'} must not be empty")
    if len(prompts) > max_prompts:
        raise ValueError(f"at most {max_prompts} prompts per request")
    for ids in prompts:
        if isinstance(ids, list):
            _check_vocabulary(ids, info)
    return prompt


# The completions API's own default (OpenAI's, vLLM's), so a model's default limit does not bound it.
COMPLETION_MAX_TOKENS = 16


class TextPromptEncoding(_Request):
    """How a completion's or an embedding's text prompts become tokens."""

    add_special_tokens: bool = Field(True, description="vLLM's: false encodes a text prompt without the BOS the "
                                     "model's tokenizer asks for (a prompt of token ids is always taken as it is)")


class CompletionRequest(SamplingRequest, TextPromptEncoding):
    prompt: Prompt
    max_tokens: int = Field(COMPLETION_MAX_TOKENS, ge=0,
                            description="0 only with echo: the prompt alone, scored with logprobs")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = Field(None, description="not supported: must be empty", json_schema_extra={"maxLength": 0})

    _check_prompts = field_validator("prompt")(check_prompts)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str) -> str:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @model_validator(mode="after")
    def _no_tokens_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "max_tokens 0 needs echo (the prompt is then the whole answer)",
                              self.max_tokens)
        return self

    def _logprob_params(self) -> dict[str, Any]:
        """With echo, the prompt's tokens get their logprobs too (OpenAI's legacy API; what lm-eval scores with),
        as with vLLM's prompt_logprobs: the engine scores the prompt for the more alternatives of the two."""
        scored = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return {"logprobs": self.logprobs is not None, "top_logprobs": self.logprobs or 0,
                "prompt_logprobs": max(scored, default=None)}


class TextPart(_Request):
    type: Literal["text"]
    text: str


class RefusalPart(_Request):
    """An earlier reply's refusal sent back: text the model wrote, shown to it again as its message's text (as vLLM
    reads a refusal part)."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


# --- tool calling ---------------------------------------------------------------------------------
# A function's `parameters` schema is compiled by the engine's grammar compiler before the request is queued
# (app/routes.py), so a malformed one is a 400 whatever the tool_choice.

ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


class FunctionDefinition(_Request):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="with tool_choice auto, a call the model chooses to make follows "
                                "the schema too (forced calls always do)")

    @field_validator("parameters")
    @classmethod
    def _of_an_object(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        # As OpenAI checks: a call's arguments are an object, and a call forced to another type would be read as
        # none (its markup as the message's text). A schema that names no type constrains nothing here.
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError(f"schema must be a JSON Schema of 'type: \"object\"', got 'type: "
                             f"{json.dumps(schema['type'])}'")
        return schema


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(_Request):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Request):
    """OpenAI's `allowed_tools`: the reply may call only these of the request's tools (`mode` as tool_choice `auto`
    or `required` would), while the prompt shows them all (its prefix, cached, stays the same as the list
    changes)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    @property
    def mode(self) -> Literal["auto", "required"]:
        return self.allowed_tools.mode

    def names(self) -> set[str]:
        return {tool.function.name for tool in self.allowed_tools.tools}


ToolChoice = Annotated[NamedToolChoice | AllowedToolsChoice, Field(discriminator="type")] | str


class FunctionCallParam(_Request):
    name: str
    arguments: str = Field(description='the arguments as a JSON object\'s text ("" reads as "{}", as vLLM reads it)')

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        if value == "":  # some servers stream a call of a function without parameters so; agents send it back
            return "{}"
        try:
            parsed = json.loads(value, parse_constant=not_json)
        except (ValueError, RecursionError):  # RecursionError: nested too deep for the parser
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object's text")
        return value


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | RefusalPart, Field(discriminator="type")]] | None = None
    refusal: str | None = Field(None, description="an assistant's refusal sent back, shown to the model as its text")
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")
    reasoning_content: str | None = Field(
        None, validation_alias=AliasChoices("reasoning_content", "reasoning"),
        description="an assistant's reasoning before its reply (also taken as `reasoning`, as vLLM takes both); the "
                    "chat template sees it as the message's `reasoning_content` and `reasoning`")

    _text_only = field_validator("content", mode="before")(text_parts_only("text", "refusal"))

    @model_validator(mode="before")
    @classmethod
    def _reasoning_is_an_assistants(cls, data: Any) -> Any:
        # Checked on the body as sent, so that the 400 names the key the client wrote (`reasoning`, say).
        if isinstance(data, dict) and data.get("role") in ("system", "developer", "user", "tool"):
            for key in ("reasoning_content", "reasoning"):
                if data.get(key) is not None:
                    raise field_error(key, "only assistant messages have reasoning", data[key])
        return data

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise field_error("tool_calls", "only assistant messages have tool_calls", self.tool_calls)
        if self.role != "assistant" and (self.refusal is not None or self._has_refusal_parts()):
            field = "refusal" if self.refusal is not None else "content"
            raise field_error(field, "only assistant messages have refusals", getattr(self, field))
        if self.content is None and not self.tool_calls and self.reasoning_content is None and self.refusal is None:
            raise field_error("content", "content is required (an assistant message may give tool_calls, reasoning "
                              "or a refusal instead)", None)
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise field_error("tool_call_id", "tool messages, and only they, need tool_call_id", self.tool_call_id)
        return self

    def _has_refusal_parts(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(part, RefusalPart) for part in self.content)

    def text(self) -> str:
        """The content's text (its parts joined by newlines), then a refusal sent as the `refusal` field."""
        content = self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content or ())
        return f"{content}\n{self.refusal}" if content and self.refusal else content or self.refusal or ""


class ChatRendering(_Request):
    """How the messages become the prompt through the model's chat template (vLLM's fields)."""

    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="end the prompt inside the final message, an "
                                         "assistant's, so the reply continues its text")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict,
                                                 description="more variables for the template, e.g. enable_thinking")
    documents: list[dict[str, str]] | None = Field(None, description="vLLM's: documents for a template that "
                                                   "writes them (retrieval-augmented generation: Granite's, Command "
                                                   "R's), each with its title and text; chat_template_kwargs' "
                                                   "documents, if set, come instead")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="OpenAI's: the template's `reasoning_effort`, and its `enable_thinking` (false for none) "
                          "unless chat_template_kwargs sets it, as vLLM passes them")
    add_special_tokens: bool = Field(False, description="vLLM's: true adds the BOS the model's tokenizer asks for "
                                     "where the rendered prompt does not begin with it (never a second one); false: "
                                     "the special tokens are the chat template's alone")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template_variable_replaced(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if taken := sorted(TEMPLATE_VARIABLES.intersection(kwargs)):
            raise ValueError(f"{', '.join(taken)} cannot be set here: the server gives the template these")
        return kwargs

    @model_validator(mode="after")
    def _a_final_assistant_message_to_continue(self) -> ChatRendering:
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise field_error("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                              "both be true", True)
        final = self.messages[-1] if self.messages else None
        if final is None or final.role != "assistant" or final.tool_calls or not final.text().strip():
            raise field_error("continue_final_message", "continue_final_message needs a final assistant message "
                              "with text and no tool_calls", True)
        return self

    def rendering(self) -> dict[str, Any]:
        """`chat_prompt`'s keyword arguments for these fields."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "template_kwargs": self._template_kwargs(),
                "add_special_tokens": self.add_special_tokens}

    def _template_kwargs(self) -> dict[str, Any]:
        """The template's variables beside the messages and tools, as vLLM gives them: chat_template_kwargs over the
        request's own."""
        own = {} if self.documents is None else {"documents": self.documents}
        if self.reasoning_effort is None:
            return {**own, **self.chat_template_kwargs}
        return {**own, "enable_thinking": self.reasoning_effort != "none", **self.chat_template_kwargs,
                "reasoning_effort": self.reasoning_effort}


class ChatCompletionRequest(SamplingRequest, ChatRendering):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDefinition] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto", "required", a named function or '
                                           'allowed_tools; default: "auto" with tools, "none" without')
    parallel_tool_calls: bool = Field(True, description="false: at most one call (the first the reply writes)")
    thinking_token_budget: int | None = Field(
        None, ge=0, description="vLLM's: the most tokens the reasoning may take, then </think> is forced (needs a "
                                "--reasoning-parser and a vocabulary whose <think> and </think> are tokens)")
    functions: list[dict[str, Any]] | None = Field(None, description="not supported (use tools): must be empty",
                                                   json_schema_extra={"maxItems": 0})
    function_call: str | dict[str, Any] | None = Field(None, description='not supported (use tool_choice): only "none"',
                                                       json_schema_extra={"const": "none"})

    # A template sent with the request (vLLM serves one only with --trust-request-chat-template), vLLM's chat echo
    # (the reply prefixed with a last message of its role), and OpenAI's audio output, web search and moderation.
    unsupported: ClassVar[dict[str, Any]] = {**UNSUPPORTED_FIELDS, "chat_template": _ANY, "echo": False,
                                             "modalities": ["text"], "audio": _ANY, "web_search_options": _ANY,
                                             "moderation": _ANY}

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolDefinition]) -> list[ToolDefinition]:
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct names")
        return tools

    _named_function = field_validator("tool_choice", mode="before")(
        named_function_choice('{"type": "function", "function": {"name": ...}}', "function"))

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: ToolChoice, info: ValidationInfo) -> ToolChoice:
        if isinstance(choice, str) and choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, a named function or "
                             "allowed_tools")
        names = {tool.function.name for tool in info.data.get("tools", [])}
        named = ({choice.function.name} if isinstance(choice, NamedToolChoice)
                 else choice.names() if isinstance(choice, AllowedToolsChoice) else set())
        if unknown := sorted(named - names):
            raise ValueError(f"tool_choice names {unknown[0]!r}, which is not among the tools")
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return choice

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if value:
            raise ValueError("functions are not supported; use tools")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        if value != "none":
            raise ValueError('function_call other than "none" is not supported; use tool_choice')
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs requires logprobs to be true", self.top_logprobs)
        return self

    @model_validator(mode="after")
    def _forced_calls_are_the_grammar(self) -> ChatCompletionRequest:
        # A response_format holds a text answer, which a forced reply never has (as in OpenAI's API).
        if self.forced_tools() and self.structured_outputs is not None:
            raise field_error("tool_choice", "a required or named tool_choice cannot be combined with "
                              "structured_outputs: the calls are the output's grammar", self.tool_choice)
        if self.forced_tools():
            self._no_ending_forced("a required or named tool_choice")
        if self.allowed_token_ids and (self.forced_tools() or self.thinking_token_budget is not None):
            raise field_error("allowed_token_ids", "allowed_token_ids cannot be combined with a required or named "
                              "tool_choice or a thinking_token_budget: their grammar decides which tokens are "
                              "allowed", self.allowed_token_ids)
        return self

    def active_tools(self, exclude_when_none: bool = False) -> list[ToolDefinition]:
        """The tools the chat template is shown. As vLLM's (since 0.10), with tool_choice "none" too: the model knows
        them, but its reply is not read for calls (`callable_tools`); `exclude_when_none` (the server's
        --exclude-tools-when-tool-choice-none) leaves them out then, as before."""
        return [] if exclude_when_none and self.tool_choice == "none" else self.tools

    def callable_tools(self) -> list[ToolDefinition]:
        """The tools the reply is read for calls of: none with tool_choice "none" (its text is all content), those
        listed with allowed_tools."""
        if isinstance(self.tool_choice, AllowedToolsChoice):
            return [tool for tool in self.tools if tool.function.name in self.tool_choice.names()]
        return [] if self.tool_choice == "none" else self.tools

    def forced_tools(self) -> list[ToolDefinition]:
        """The tools one of which must be called (required: any; allowed_tools required: any listed; named: that
        one), or [] if the model chooses."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [tool for tool in self.tools if tool.function.name == self.tool_choice.function.name]
        required = isinstance(self.tool_choice, AllowedToolsChoice) and self.tool_choice.mode == "required"
        return self.callable_tools() if required or self.tool_choice == "required" else []

    def holds_chosen_calls(self) -> bool:
        """Whether a grammar holds the calls the model chooses to make (tool_choice auto) to their tools' schemas:
        where a tool it may call asks for `strict`, unless something else already constrains the reply
        (response_format, structured_outputs, allowed_token_ids, ignore_eos, min_tokens) or it continues a prefill,
        which may end inside a call."""
        return (not self.forced_tools() and any(tool.function.strict for tool in self.callable_tools())
                and self.structured() is None and not self.allowed_token_ids and not self.ignore_eos
                and not self.min_tokens and not self.continue_final_message)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprob_params(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}


class TokenizeRequest(ChatRendering):
    model: str | None = None
    prompt: str | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS,
                                               description="with messages: rendered as a chat request's are")
    return_token_strs: bool = Field(False, description="also each token's string in the vocabulary (`token_strs`)")

    @model_validator(mode="before")
    @classmethod
    def _special_tokens_as_a_completions(cls, data: Any) -> Any:
        # vLLM's defaults: a prompt gets them as a completion's does; messages only what their template writes.
        if isinstance(data, dict) and data.get("prompt") is not None and data.get("add_special_tokens") is None:
            return {**data, "add_special_tokens": True}
        return data

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise field_error("prompt", "give exactly one of prompt or messages", self.prompt)
        if self.tools and self.messages is None:
            raise field_error("tools", "tools are rendered with messages; a prompt is encoded as it is", self.tools)
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]

    _check_tokens = field_validator("tokens")(_check_vocabulary)


# --- responses --------------------------------------------------------------------------------


class _AskedFor(BaseModel):
    """A response part with fields of vLLM's that are sent only when the request asks for them (`asked_for`): left
    out, not null, otherwise (a request without them never sees the keys, on no streamed chunk)."""

    asked_for: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _only_when_asked(self, handler) -> dict[str, Any]:
        data = handler(self)
        for key in self.asked_for:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class UsageInfo(_AskedFor):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="with a --reasoning-parser: the reasoning's tokens (its text encoded again)")

    asked_for: ClassVar[tuple[str, ...]] = ("completion_tokens_details",)


class CompletionLogprobs(BaseModel):
    """A prompt's first token, echoed, has no logprob (nothing comes before it): null there."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]

    def then(self, other: CompletionLogprobs) -> CompletionLogprobs:
        """These tokens', then `other`'s."""
        return CompletionLogprobs(tokens=self.tokens + other.tokens,
                                  token_logprobs=self.token_logprobs + other.token_logprobs,
                                  top_logprobs=(self.top_logprobs or []) + (other.top_logprobs or []),
                                  text_offset=self.text_offset + other.text_offset)


StopReason = int | str | None  # vLLM's: the stop string or stop token id that ended a choice (None: EOS, length)


class PromptTokenLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`: a token's logprob, its rank in the vocabulary (1: the most likely) and
    its text."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token (null for the first), its entry and its best alternatives', keyed by token id.
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(_AskedFor):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's: only when asked for (not streamed)")
    prompt_token_ids: list[int] | None = Field(None, description="vLLM's (return_token_ids): streamed, on the "
                                               "choice's first chunk")
    token_ids: list[int] | None = Field(None, description="vLLM's (return_token_ids): streamed, the chunk's own")

    asked_for: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "prompt_token_ids", "token_ids")


class CompletionResponse(BaseModel):
    """Both the whole response and, with one choice increment, a stream chunk (same `object`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo]
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_AskedFor):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = Field(None, description="vLLM's: the reply's reasoning (--reasoning-parser)")
    reasoning_content: str | None = Field(None, description="the same, by its older name (SGLang's, llama.cpp's)")

    asked_for: ClassVar[tuple[str, ...]] = ("reasoning", "reasoning_content")


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(_AskedFor):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(None, description="vLLM's (return_token_ids)")

    asked_for: ClassVar[tuple[str, ...]] = ("token_ids",)


class ChatCompletionResponse(_AskedFor):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's: the prompt's (prompt_logprobs)")
    prompt_token_ids: list[int] | None = Field(None, description="vLLM's (return_token_ids)")

    asked_for: ClassVar[tuple[str, ...]] = ("prompt_token_ids",)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A call's first delta has its id, type and name (arguments ""); the next ones fragments of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(_AskedFor):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(None, description="vLLM's (return_token_ids): the chunk's new ones")

    asked_for: ClassVar[tuple[str, ...]] = ("token_ids",)

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: ChatDelta) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: `{"content": "Hi"}`, and `{}` on the finishing chunk; a field set
        # to None is sent as null (the content beside the call a reply opens with: OpenAI's `"content": null`).
        data = delta.model_dump(exclude_none=True)
        return {name: data.get(name) for name in ChatDelta.model_fields
                if name in data or name in delta.model_fields_set}


class ChatCompletionChunk(_AskedFor):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = Field(None, description="vLLM's (return_token_ids): on the first chunk")

    asked_for: ClassVar[tuple[str, ...]] = ("prompt_token_ids",)


class ModelCard(BaseModel):
    """The served model as OpenAI's clients read it (`id`, `object`, `created`, `owned_by`) and as Anthropic's do
    (`type`, `display_name`, `created_at`, RFC 3339, and `lifecycle`, which the anthropic client's ModelInfo
    requires). `max_input_tokens` and `max_tokens`, Anthropic's: the context less the one token a reply needs, and
    what a prompt of one token leaves (the most a Messages request's `max_tokens` gets). vLLM's `root`, what the model
    was loaded from (the model `sluice serve` was given, a LoRA adapter's folder; None where not known), and `parent`,
    a LoRA adapter's base model (None for the base itself)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    max_model_len: int
    type: Literal["model"] = "model"
    display_name: str
    created_at: str
    lifecycle: Literal["active"] = "active"
    max_input_tokens: int
    max_tokens: int
    root: str | None = None
    parent: str | None = None

    @classmethod
    def of(cls, model: str, created: int, max_model_len: int, root: str | None,
           parent: str | None = None) -> ModelCard:
        created_at = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")
        return cls(id=model, created=created, max_model_len=max_model_len, display_name=model, created_at=created_at,
                   max_input_tokens=max_model_len - 1, max_tokens=max_model_len - 1, root=root, parent=parent)


class ModelList(BaseModel):
    """OpenAI's list, with the page fields of Anthropic's (one page: the served model, then its LoRA adapters)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
