"""Pydantic models of OpenAI's Responses API (`/v1/responses`): the request, its input items, the response object
and its output items.

They reuse the chat models' pieces where the two APIs share a shape (a function's definition, the call arguments'
check, the text formats). What the request says about tools, formats and sampling is checked again, once, where
it is turned into a chat request (`responses_api_convert.py`), so a rule lives in one place.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StringConstraints, Tag, \
    field_validator, model_validator

from sluice.app.schemas import (
    FunctionCallParam,
    FunctionDefinition,
    JsonObjectFormat,
    JsonSchemaSpec,
    MODERATION_HINT,
    ReasoningEffort,
    RefusalPart,
    TextFormat,
    TokenLogprobInfo,
    _Request,
    field_error,
    named_function_choice,
    text_parts_only,
)

# OpenAI's limits on `metadata`.
MAX_METADATA_KEYS = 16
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_KEYS)]
# Fields that would change the output but are not implemented: refused by name (when set) rather than ignored, with
# what the refusal adds after "<field> is not supported".
_UNSUPPORTED = {"prompt": "", "moderation": MODERATION_HINT}
# OpenAI's `include` values. Only the logprobs one adds anything here: the others name items (hosted tools'
# results, images, encrypted reasoning) that Sluice's responses never hold.
Includable = Literal["message.output_text.logprobs", "file_search_call.results", "web_search_call.results",
                     "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs",
                     "reasoning.encrypted_content"]
LOGPROBS = "message.output_text.logprobs"

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# --- input items ------------------------------------------------------------------------------------------


class InputText(_Request):
    """A text part as the user sends it (in a message, or a function's output)."""

    type: Literal["input_text"] = "input_text"
    text: str


class OutputTextPart(_Request):
    """An earlier reply's text part, with the `annotations` (none here) that OpenAI's output text always has."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)


TextPart = Annotated[InputText | OutputTextPart, Field(discriminator="type")]


class MessageItem(_Request):
    """A message; `id` is kept when this server holds an item by it (an earlier output item sent back), else made
    when the item is stored (as for every input item: `responses_api_convert.stored_items`)."""

    type: Literal["message"] = "message"
    id: str | None = None
    status: ItemStatus | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | OutputTextPart | RefusalPart, Field(discriminator="type")]]

    _text_only = field_validator("content", mode="before")(text_parts_only("input_text", "output_text", "refusal"))

    @model_validator(mode="after")
    def _refusals_are_the_assistants(self) -> MessageItem:
        if self.role != "assistant" and any(isinstance(part, RefusalPart) for part in self.content):
            raise ValueError("refusal parts belong in assistant messages")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(FunctionCallParam):
    """An earlier call of the model's: `name` and `arguments` (a JSON object's text) as a chat tool call has them."""

    type: Literal["function_call"]
    id: str | None = None
    status: ItemStatus | None = None
    call_id: str


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    id: str | None = None
    status: ItemStatus | None = None
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


class ReasoningText(_Request):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(_Request):
    """An earlier reply's reasoning, as agent SDKs send it back (Sluice's own with a --reasoning-parser, or another
    model's). It stays in the conversation (stored, listed among the input items), and its text is the reasoning of
    the assistant message it comes before (`responses_api_convert.chat_messages`), which only a reasoning model's
    chat template shows."""

    type: Literal["reasoning"]
    id: str | None = None
    status: ItemStatus | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None

    def text(self) -> str:
        """The reasoning itself (its content, as vLLM writes it), else its summary (all that OpenAI's models send); ""
        for encrypted reasoning alone."""
        return "\n".join(part.text for part in self.content or self.summary)


class ItemReference(_Request):
    """An item of a stored response's conversation (its input or output), by id: the request's input holds that
    item in its place (`responses_api.py` looks it up before anything reads the input)."""

    type: Literal["item_reference"] = "item_reference"
    id: str


def item_type(item: Any) -> str:
    """An item's type. A message may leave it out (OpenAI's "easy input message"), and so may an item reference:
    then it is an `id` without a `role`."""
    if not isinstance(item, dict):
        return getattr(item, "type", "message")
    return item.get("type") or ("item_reference" if "id" in item and "role" not in item else "message")


STORED_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ITEM_TYPES = (*STORED_ITEM_TYPES, "item_reference")


def _items_of(*types: str) -> BeforeValidator:
    """Another type of item (a hosted tool's call, say) is refused by its type, not in pydantic's words (which name
    `item_type`)."""

    def supported(item: Any) -> Any:
        if (kind := item_type(item)) not in types:
            raise ValueError(f"items of type {kind!r} are not supported: only {', '.join(types)}")
        return item

    return BeforeValidator(supported)


_ITEMS = (Annotated[MessageItem, Tag("message")]
          | Annotated[FunctionCallItem, Tag("function_call")]
          | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
          | Annotated[ReasoningItem, Tag("reasoning")])
# An item of a conversation, as stored.
InputItem = Annotated[_ITEMS, Discriminator(item_type)]
# An item of a request's input: a conversation's, or a reference to a stored one.
RequestItem = Annotated[_ITEMS | Annotated[ItemReference, Tag("item_reference")], Discriminator(item_type),
                        _items_of(*ITEM_TYPES)]
# An item added to a conversation of the Conversations API (`conversations_schemas.py`): no reference.
AddedItem = Annotated[_ITEMS, Discriminator(item_type), _items_of(*STORED_ITEM_TYPES)]


# --- the request ------------------------------------------------------------------------------------------


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat form: `{type, name, description, parameters, strict}`."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        # A hosted tool (web_search, file_search, ...) named by its type, not by the `name` it lacks.
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "function":
            raise ValueError(f"tools of type {data['type']!r} are not supported: only function tools")
        return data


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(_Request):
    """OpenAI's `allowed_tools`, in the Responses API's flat form: the chat request's (`schemas.AllowedToolsChoice`)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionToolChoice] = Field(min_length=1)


ToolChoice = Annotated[FunctionToolChoice | AllowedToolsChoice, Field(discriminator="type")] | Literal[
    "none", "auto", "required"]


class JsonSchemaTextFormat(JsonSchemaSpec):
    model_config = ConfigDict(serialize_by_alias=True)

    type: Literal["json_schema"]


TextFormatSpec = Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")]


class TextConfig(_Request):
    format: TextFormatSpec = Field(default_factory=lambda: TextFormat(type="text"))


class ReasoningConfig(_Request):
    effort: ReasoningEffort | None = Field(None, description="the chat template's reasoning_effort, as vLLM passes it")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted and not honoured: no summarizer, so reasoning items have no summary")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="summary's older name")


def _asks(value: Any) -> bool:
    """Whether a field's value asks for something: `{"effort": null}`, as clients send for "not set", does not."""
    return any(v is not None for v in value.values()) if isinstance(value, dict) else bool(value)


Truncation = Literal["auto", "disabled"]


class ConversationReference(_Request):
    """The conversation of the Conversations API a response belongs to (`conversations.py`)."""

    id: str


class ResponsesRequest(_Request):
    model: str | None = None
    input: list[RequestItem] = Field(min_length=1, description="a string (one user message) or a list of items")
    instructions: str | None = Field(None, description="a system message before the input; not carried over by "
                                                        "previous_response_id")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    include: list[Includable] = Field(default_factory=list,
                                      description='"message.output_text.logprobs": the text\'s token logprobs')
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives listed with each token's "
                                                                    "logprob (and logprobs included)")
    stream: bool = False
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = Field(None, description='default: "auto" with tools, "none" without')
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=0, description="the most calls of built-in tools, of which Sluice "
                                                               "has none (function calls are the client's to run)")
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    store: bool = Field(True, description="keep the response for GET and previous_response_id (bounded, in memory)")
    background: bool = Field(False, description="run it apart from the connection (stored, so needs store): the "
                                                "answer comes at once, queued; GET polls it, POST .../cancel stops it")
    previous_response_id: str | None = None
    conversation: str | ConversationReference | None = Field(
        None, description="a conversation's id (or {\"id\": ...}): its items come before the input, and once the "
                          "response has ended (completed or incomplete) its input and output are added to it; read "
                          "as {\"id\": ...} either way")
    metadata: Metadata = Field(default_factory=dict)
    user: str | None = None
    truncation: Truncation = Field("disabled", description='"auto": a conversation longer than the context drops '
                                                           "its oldest turns; \"disabled\": it is a 400")

    _named_function = field_validator("tool_choice", mode="before")(
        named_function_choice('{"type": "function", "name": ...}', "name"))

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and (given := [name for name in _UNSUPPORTED if _asks(data.get(name))]):
            raise field_error(given[0], f"{given[0]} is not supported{_UNSUPPORTED[given[0]]}", data[given[0]])
        return data

    @field_validator("conversation")
    @classmethod
    def _conversation_by_id(cls, value: str | ConversationReference | None) -> ConversationReference | None:
        return ConversationReference(id=value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_earlier_context(self) -> ResponsesRequest:
        if self.conversation is not None and self.previous_response_id is not None:  # OpenAI's 400, in its words
            raise ValueError("Mutually exclusive parameters. Ensure you are only providing one of: "
                             "'previous_response_id' or 'conversation'.")
        return self

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesRequest:
        # OpenAI's rule: a background response is polled, so it must be stored.
        if self.background and not self.store:
            raise field_error("background", "background: a background response must be stored (store: true)", True)
        return self

    @model_validator(mode="before")
    @classmethod
    def _string_input_is_a_user_message(cls, data: Any) -> Any:
        # Checked as items, so that a bad item's error names its place (`input.0.message.role`).
        if isinstance(data, dict) and isinstance(data.get("input"), str):
            return {**data, "input": [{"role": "user", "content": data["input"]}]}
        return data

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries its tokens' logprobs: asked by `include`, or by `top_logprobs`."""
        return LOGPROBS in self.include or self.top_logprobs is not None


class InputTokensRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`' request: a response's, whose `input` may be left out where there is
    something else to count (OpenAI's is optional there): a conversation, or an earlier response's."""

    input: list[RequestItem] = Field(default_factory=list, description="a string (one user message) or a list of "
                                                                       "items; optional with conversation or "
                                                                       "previous_response_id")

    @model_validator(mode="after")
    def _something_to_count(self) -> InputTokensRequest:
        if not self.input and self.conversation is None and self.previous_response_id is None:
            raise field_error("input", "input: required without conversation or previous_response_id", [])
        return self


# --- the response -----------------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[TokenLogprobInfo] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The reply's reasoning (--reasoning-parser), as vLLM writes it: its text as content, no summary."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    status: ItemStatus


OutputItem = Annotated[OutputReasoning | OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    """`cached_tokens`: the prompt's prefix the prefix cache held. `cache_write_tokens` is 0: OpenAI counts there the
    tokens a request's prompt caching writes to be kept (billed apart); Sluice caches every prompt's prefix by
    itself, for as long as the pool has room, and no request asks it to."""

    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response failed. OpenAI's codes are a closed list that typed clients hold to (the openai package's
    `Response` refuses another); what fails a response after its stream began is the server's side, whatever the
    message says of it."""

    code: Literal["server_error"]
    message: str


class ResponseObject(BaseModel):
    """The response, whole or as the streamed events' `response` (then `in_progress`, or `failed` with `error`);
    a background one is `queued` when created, and may end `cancelled`. The request's settings are echoed as OpenAI
    does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    max_tool_calls: int | None = None
    previous_response_id: str | None
    conversation: ConversationReference | None = None
    temperature: float
    top_p: float
    top_logprobs: int | None = None
    tool_choice: ToolChoice
    tools: list[FunctionTool]
    text: TextConfig
    reasoning: ReasoningConfig | None = None
    store: bool
    background: bool = False
    metadata: dict[str, str]
    truncation: Truncation = "disabled"
    user: str | None = None
    usage: ResponseUsage | None = None


class ResponseStreamEvent(BaseModel):
    """One streamed event, sent as `event: <type>` and `data: <this>`: `response.created`, `.in_progress`,
    `.output_item.added`, `.content_part.added`, `.output_text.delta` / `.done`, `.content_part.done`,
    `.reasoning_text.delta` / `.done`, `.function_call_arguments.delta` / `.done`, `.output_item.done`, then
    `.completed` (or `.incomplete`, `.failed`); the other fields are the type's, as OpenAI sends them."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class RetrieveQuery(_Request):
    """`GET /v1/responses/{id}`'s query: `stream` replays the events of a background response created with
    `stream: true`, those after the sequence number `starting_after` (all without it), then follows it to its end."""

    include: list[Includable] = Field(default_factory=list)
    stream: bool = False
    starting_after: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _starting_after_streams(self) -> RetrieveQuery:
        # A JSON answer has no events to start after: refused rather than ignored.
        if self.starting_after is not None and not self.stream:
            raise field_error("starting_after", "only with stream: true", self.starting_after)
        return self


class InputItemsQuery(_Request):
    """`GET /v1/responses/{id}/input_items`'s query: `limit` items after the item `after`, in `order`."""

    after: str | None = None
    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    include: list[Includable] = Field(default_factory=list)


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, page: list[InputItem], has_more: bool) -> InputItemList:
        return cls(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                   has_more=has_more)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


class InputTokenCount(BaseModel):
    input_tokens: int
    object: Literal["response.input_tokens"] = "response.input_tokens"
