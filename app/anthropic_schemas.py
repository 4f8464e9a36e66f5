"""Pydantic models of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): requests, the
`message` response, its stream events and the error body.

Requests are checked here as the OpenAI ones are in `schemas.py` (types and ranges; unknown fields ignored;
content blocks Sluice cannot show the model, such as images, rejected by their `type`), then turned into a chat
request by `anthropic_messages.py`, which checks what the two APIs share.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, RootModel, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from sluice.app.schemas import MAX_STOP_STRINGS, MAX_TOOLS, ToolName, _Request

# --- requests ---------------------------------------------------------------------------------


class TextBlockParam(_Request):
    type: Literal["text"]
    text: str


def _string_or_blocks(value: Any) -> str | None:
    return "string" if isinstance(value, str) else "blocks" if isinstance(value, list) else None


def _text_or(blocks: Any) -> Any:
    """`str | blocks` for a field that is a string or a list of blocks, told apart by the value's type: a faulty
    block is then refused in its own words (`content.blocks.0.text.text: Field required`), where the plain union
    answered any list it refused with its first member's complaint, `content.str: Input should be a valid string`."""
    return Annotated[Annotated[str, Tag("string")] | Annotated[blocks, Tag("blocks")],
                     Discriminator(_string_or_blocks, custom_error_type="string_or_blocks",
                                   custom_error_message="Input should be a string or a list of content blocks")]


TextContent = _text_or(list[TextBlockParam])


class ToolUseBlockParam(_Request):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(_Request):
    """A call's result, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: TextContent = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(_Request):
    """An earlier reply's reasoning, in an assistant message: the chat template sees it as the message's
    `reasoning_content` (its signature, which Anthropic checks, is not shown)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(_Request):
    """Reasoning Anthropic encrypted: no text a model here can read, so left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam
                              | RedactedThinkingBlockParam, Field(discriminator="type")]


# The block types Sluice can show the model (or, redacted thinking, accept and leave out): in a message, and in a
# tool result's content.
_MESSAGE_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
_RESULT_BLOCKS = ("text",)


def _refuse_unsupported_blocks(content: Any, supported: tuple[str, ...], where: str) -> None:
    """Refuses the first block of raw `content` (and of its tool results' content) whose type is not `supported`,
    naming it: left to the union `str | list[block]`, it would be reported as content that is not a string."""
    if not isinstance(content, list):
        return
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            continue
        if kind not in supported:
            raise PydanticCustomError("unsupported_block", "{where}: '{kind}' blocks are not supported (only "
                                      "{supported})", {"where": f"{where}.{i}", "kind": kind,
                                                       "supported": ", ".join(supported)})
        if kind == "tool_result":
            _refuse_unsupported_blocks(block.get("content"), _RESULT_BLOCKS, f"{where}.{i}.content")


MessageContent = _text_or(list[ContentBlockParam])


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: MessageContent

    @model_validator(mode="before")
    @classmethod
    def _supported_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_unsupported_blocks(data.get("content"), _MESSAGE_BLOCKS, "content")
        return data

    def blocks(self) -> list[ContentBlockParam]:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlockParam(type="text", text=self.content)]
        return self.content

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> MessageParam:
        blocks = [] if isinstance(self.content, str) else self.content
        if self.role == "user" and any(isinstance(b, ToolUseBlockParam) for b in blocks):
            raise _misplaced("tool_use", "assistant")
        if self.role == "user" and any(isinstance(b, ThinkingBlockParam | RedactedThinkingBlockParam) for b in blocks):
            raise _misplaced("thinking", "assistant")
        if self.role == "assistant" and any(isinstance(b, ToolResultBlockParam) for b in blocks):
            raise _misplaced("tool_result", "user")
        return self


def _misplaced(kind: str, role: str) -> PydanticCustomError:
    return PydanticCustomError("misplaced_block", "{kind} blocks belong in {role} messages", {"kind": kind,
                                                                                             "role": role})


class ToolParam(_Request):
    """A custom tool: the model calls it, the client runs it and answers with a tool_result. Anthropic's other
    kinds (server tools such as web_search, Anthropic-defined client tools such as bash, MCP toolsets) are refused
    by their type: their schemas and runners are Anthropic's."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the call's input object")
    eager_input_streaming: bool | None = Field(None, description="true: a stream sends the call's input as it is "
                                                                 "sampled, not a whole parameter at a time")
    strict: bool | None = Field(None, description="true: a call the model chooses to make follows input_schema "
                                                  "(calls tool_choice any or tool forces always do)")

    @model_validator(mode="before")
    @classmethod
    def _custom(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            name = f" ({data['name']})" if isinstance(data.get("name"), str) else ""
            raise PydanticCustomError("unsupported_tool", "'{kind}' tools{name} are not supported: only custom tools "
                                      "(a name, a description and an input_schema) are", {"kind": kind, "name": name})
        return data

    @field_validator("input_schema")
    @classmethod
    def _of_an_object(cls, schema: dict[str, Any]) -> dict[str, Any]:
        # As Anthropic checks: a tool_use block's input is an object, and a call forced to another type could
        # only be given as one cut short.
        if schema.get("type") != "object":
            raise PydanticCustomError("input_schema_type", "the schema's type must be 'object': a tool_use "
                                      "block's input is an object")
        return schema


class _ToolChoiceBase(_Request):
    disable_parallel_tool_use: bool = Field(False, description="with any: exactly one call")


class ToolChoiceAuto(_ToolChoiceBase):
    type: Literal["auto"]


class ToolChoiceAny(_ToolChoiceBase):
    type: Literal["any"]


class ToolChoiceTool(_ToolChoiceBase):
    type: Literal["tool"]
    name: str


class ToolChoiceNone(_Request):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Request):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024, description="less than max_tokens: the most tokens the thinking may take, "
                                                    "with a --reasoning-parser where each tag is a token")


class ThinkingSwitch(_Request):
    """Thinking on (`adaptive`, `between_tools`: the model decides how much) or off (`disabled`)."""

    type: Literal["adaptive", "between_tools", "disabled"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingSwitch, Field(discriminator="type")]


class JsonOutputFormat(_Request):
    """Anthropic's structured output: the reply's text is JSON that follows `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="the chat template's reasoning_effort, as vLLM passes it")
    format: JsonOutputFormat | None = Field(None, description="structured output: chat's response_format "
                                                              "json_schema")


class CountTokensRequest(_Request):
    """What a prompt is rendered from; `/v1/messages/count_tokens` takes this alone."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: TextContent | None = None
    tools: list[ToolParam] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without")
    thinking: ThinkingConfig | None = Field(None, description="the chat template's enable_thinking: false if "
                                                              "disabled, else true (unset: the template's default)")
    output_config: OutputConfig | None = None
    mcp_servers: list[dict[str, Any]] = Field(default_factory=list,
                                              description="remote MCP servers (beta) are not connected to: refused")

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp_servers(cls, servers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if servers:
            names = ", ".join(str(server.get("name")) for server in servers)
            raise PydanticCustomError("mcp_servers_unsupported", "remote MCP servers ({names}) are not supported: "
                                      "give their tools as custom tools, which the client runs", {"names": names})
        return servers

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = {tool.name for tool in info.data.get("tools", [])}
        # As Anthropic refuses it, in its words: a choice among no tools (but none, which calls none).
        if not names and isinstance(choice, ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool):
            raise PydanticCustomError("tool_choice_without_tools",
                                      "tool_choice may only be specified while providing tools.")
        if isinstance(choice, ToolChoiceTool) and choice.name not in names:
            raise PydanticCustomError("unknown_tool_choice", "tool_choice names {name}, which is not among the tools",
                                      {"name": repr(choice.name)})
        return choice

    @model_validator(mode="after")
    def _no_empty_message(self) -> CountTokensRequest:
        """As Anthropic checks: only the final message, an assistant's, may be empty (it starts no reply); an
        empty one elsewhere would leave a turn out of the prompt, or the prompt without any."""
        for i, message in enumerate(self.messages):
            if not message.content and not (i == len(self.messages) - 1 and message.role == "assistant"):
                raise PydanticCustomError("empty_message", "messages.{index}: all messages must have non-empty "
                                          "content except for the optional final assistant message", {"index": i})
        return self

    @model_validator(mode="after")
    def _text_with_text(self) -> CountTokensRequest:
        """As Anthropic checks, in its words: each text block of the system and the messages (a string content is
        one) has text, and not whitespace alone; the final message, an assistant's prefill, may be empty but does
        not end in whitespace (where the reply would start, a token boundary no tokenizer would have put there)."""
        blocks = [] if self.system is None or isinstance(self.system, str) else self.system
        if fault := _faulty_text(blocks):
            raise PydanticCustomError("empty_text_block", "system: {fault}", {"fault": fault})
        for message in self.messages:
            # An empty string, refused above but as the final assistant message, is no block.
            if message.content != "" and (fault := _faulty_text(message.blocks())):
                raise PydanticCustomError("empty_text_block", "messages: {fault}", {"fault": fault})
        final = self.turns()[-1]
        if (final.role == "assistant" and final.content and isinstance(last := final.blocks()[-1], TextBlockParam)
                and last.text != last.text.rstrip()):
            raise PydanticCustomError("trailing_whitespace", "messages: final assistant content cannot end with "
                                      "trailing whitespace")
        return self

    @model_validator(mode="after")
    def _each_call_answered_in_the_next_turn(self) -> CountTokensRequest:
        """As Anthropic checks: a tool_result answers a tool_use of the turn before it, and a tool_use (but in the
        final turn) is answered by the tool_results that open the turn after it, so that no call is shown the model
        without its result, nor a result without its call or apart from it (text before the results would come
        between them)."""
        turns = self._turn_spans()
        for t, (start, end) in enumerate(turns):
            if self.messages[start].role == "user":
                called = self._calls(turns[t - 1]) if t else set()
                for i in range(start, end):
                    for j, block in enumerate(self.messages[i].blocks()):
                        if isinstance(block, ToolResultBlockParam) and block.tool_use_id not in called:
                            raise PydanticCustomError(
                                "unexpected_tool_result", "messages.{i}.content.{j}: unexpected `tool_use_id` found "
                                "in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding "
                                "`tool_use` block in the previous message.", {"i": i, "j": j, "id": block.tool_use_id})
            elif t + 1 < len(turns):
                answered = self._leading_results(turns[t + 1])
                for i in range(start, end):
                    if unanswered := [b.id for b in self.messages[i].blocks()
                                      if isinstance(b, ToolUseBlockParam) and b.id not in answered]:
                        raise PydanticCustomError(
                            "unanswered_tool_use", "messages.{i}: `tool_use` ids were found without `tool_result` "
                            "blocks immediately after: {ids}. Each `tool_use` block must have a corresponding "
                            "`tool_result` block in the next message.", {"i": i, "ids": ", ".join(unanswered)})
        return self

    def _turn_spans(self) -> list[tuple[int, int]]:
        """Each turn's messages, as [start, end) indices: consecutive messages of one role are one turn."""
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(self.messages):
            if spans and self.messages[spans[-1][0]].role == message.role:
                spans[-1] = (spans[-1][0], i + 1)
            else:
                spans.append((i, i + 1))
        return spans

    def _calls(self, span: tuple[int, int]) -> set[str]:
        """The ids of the calls (tool_use blocks) in a turn's messages."""
        return {block.id for message in self.messages[slice(*span)] for block in message.blocks()
                if isinstance(block, ToolUseBlockParam)}

    def _leading_results(self, span: tuple[int, int]) -> set[str]:
        """The ids of the calls answered by the tool_result blocks a turn opens with (up to its first other block)."""
        blocks = [block for message in self.messages[slice(*span)] for block in message.blocks()]
        return {block.tool_use_id for block in itertools.takewhile(
            lambda block: isinstance(block, ToolResultBlockParam), blocks)}

    def turns(self) -> list[MessageParam]:
        """The messages, consecutive ones of one role as one turn, as Anthropic combines them (chat templates may
        insist that roles alternate)."""
        return [self.messages[start] if end == start + 1 else MessageParam(
            role=self.messages[start].role, content=[b for m in self.messages[start:end] for b in m.blocks()])
            for start, end in self._turn_spans()]

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)


def _faulty_text(blocks: list[Any]) -> str | None:
    """What is wrong with the first text block among `blocks` that has no text, or whitespace alone (None: none)."""
    for block in blocks:
        if isinstance(block, TextBlockParam) and not block.text.strip():
            return ("text content blocks must contain non-whitespace text" if block.text
                    else "text content blocks must be non-empty")
    return None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0, description="0: the most probable token alone")
    top_k: int = Field(0, ge=0, description="0: no top-k filter")
    stream: bool = False
    thread: dict[str, Any] | None = Field(
        None, description="message threads (beta) are not held: refused as thread_unsupported_request, which the "
                          "anthropic client's tool runner answers by sending the whole history")

    @field_validator("stop_sequences")
    @classmethod
    def _no_blank_stop_sequence(cls, sequences: list[str]) -> list[str]:
        # As Anthropic refuses them, in its words (the empty string, found in any text, would stop the reply at its
        # first token); the OpenAI routes take whitespace as a stop string.
        if any(not sequence.strip() for sequence in sequences):
            raise PydanticCustomError("blank_stop_sequence", "each stop sequence must contain non-whitespace")
        return sequences

    @model_validator(mode="after")
    def _thinking_within_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise PydanticCustomError("budget_past_max_tokens", "max_tokens must be greater than "
                                      "thinking.budget_tokens")
        return self

    @model_validator(mode="after")
    def _no_thinking_before_a_forced_call(self) -> MessagesRequest:
        """As Anthropic refuses it, in its words: a forced call (tool_choice any or tool) is where the reply
        starts, so thinking on (enabled, adaptive, between_tools) would have nowhere to go."""
        thinks = self.thinking is not None and self.thinking.type != "disabled"
        if thinks and isinstance(self.tool_choice, ToolChoiceAny | ToolChoiceTool):
            raise PydanticCustomError("thinking_with_forced_tool_use",
                                      "Thinking may not be enabled when tool_choice forces tool use.")
        return self


# --- responses --------------------------------------------------------------------------------


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    """The reply's reasoning. `signature`: the thinking's SHA-256 (Anthropic's verifies its own thinking when it is
    sent back; Sluice checks none)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


ContentBlock = Annotated[ThinkingBlock | TextBlock | ToolUseBlock, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "model_context_window_exceeded", "stop_sequence", "tool_use"]


class OutputTokensDetails(BaseModel):
    """`thinking_tokens`: how many of the output tokens the reply's reasoning was generated in, its tags included as
    Anthropic documents the field ("including the thinking-block delimiter tokens"): chat's `reasoning_tokens`
    (vLLM's count, the tokens between `<think>` and `</think>`) and the tokens of the tags the reply wrote, so that
    `output_tokens - thinking_tokens` is the answer's."""

    thinking_tokens: int


class MessageUsage(BaseModel):
    """Anthropic's split of the prompt: `input_tokens` + `cache_creation_input_tokens` + `cache_read_input_tokens`
    is its length. `cache_read_input_tokens`: the prompt's prefix found in the prefix cache (not computed again).
    `cache_creation_input_tokens` is 0: Anthropic counts there the tokens a request's `cache_control` breakpoints
    write, billed apart; Sluice caches every prompt's prefix by itself, and no request asks it to.
    `output_tokens_details`: with a --reasoning-parser alone (left out without one, as chat's
    `completion_tokens_details`)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens_details: OutputTokensDetails | None = Field(None, exclude_if=lambda details: details is None)


class Message(BaseModel):
    """The whole reply; also the `message` of a stream's `message_start` (no content or stop reason yet)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class TextDeltaBody(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    """A thinking block's signature, just before the block's stop."""

    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDelta(BaseModel):
    """A fragment of a tool_use block's input, as JSON text; the fragments join to the whole input."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDeltaBody | InputJsonDelta | ThinkingDelta | SignatureDelta, Field(discriminator="type")]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(BaseModel):
    """Sent after `message_start`, as Anthropic's API does; clients skip it."""

    type: Literal["ping"] = "ping"


StreamEvent = (MessageStartEvent | PingEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
               | MessageDeltaEvent | MessageStopEvent)


class MessageStreamEvent(RootModel[Annotated[StreamEvent, Field(discriminator="type")]]):
    """Any one event of a `stream: true` reply (each sent as `event: <type>` and `data: <this>`)."""


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str
    details: dict[str, Any] | None = Field(None, description="`error_code`: what the client may act on")


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
