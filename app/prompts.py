"""Turns request inputs into prompt token ids: completions' four prompt forms and chat messages.

Chat messages with tools, an assistant's `tool_calls` and `role: "tool"` results go through the model's chat
template as Hugging Face's `apply_chat_template(tools=...)` passes them (a call's arguments as a dict). A template
that shows no tools it is given (SmolLM2's ChatML) gets them the default way (`app/tool_calls.py`): the tool
definitions in the system prompt, past calls as `<tool_call>` text in the assistant's turn, and results as a
user turn of `<tool_response>` blocks. Mistral's templates refuse call ids that are not nine letters or digits:
with the Mistral format, ids go to the template in that form (`tool_calls.mistral_call_id`). Granite's templates
write an assistant's content alone, never its calls: with the Granite format, a template that does not write them
(`writes_calls`) gets them in the content, `<|tool_call|>[...]` as the model wrote them (as llama.cpp's copy of the
template writes them; vLLM leaves the turn empty).

An assistant's reasoning reaches the template as vLLM gives it: as the message's `reasoning_content` (what Qwen3's
and DeepSeek-R1's templates read) and `reasoning`; a template that reads neither renders as without it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from jinja2 import nodes

from sluice.model.tokenizer import ChatTemplateError, Tokenizer, compile_chat_template

from sluice.app import tool_calls
from sluice.app.errors import invalid_request
from sluice.app.schemas import ChatMessage, ToolDefinition

_PROBE_TOOL = {"type": "function", "function": {"name": "sluice_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
# A call of a name the tools do not hold: a template that lists the tools writes the tool's name whatever it does
# with calls.
_PROBE_CALL = {"id": "sluiceprb", "type": "function", "function": {"name": "sluice_probe_call", "arguments": {}}}
# Hugging Face's mark of where the final message's text ends, for `continue_final_message` (its trailing space tells
# a template that trims the text from one that does not).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class Prompt:
    """One prompt's token ids; `text` is what `echo` repeats back."""

    token_ids: list[int]
    text: str


def completion_prompts(tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]],
                       add_special_tokens: bool = True) -> list[Prompt]:
    """A string, a list of strings, a list of token ids or a list of such lists -> one `Prompt` each.
    `add_special_tokens`: a text gets the BOS the model's tokenizer asks for (ids are taken as they are)."""
    if isinstance(prompt, str):
        return [_from_text(tokenizer, prompt, add_special_tokens)]
    if all(isinstance(item, int) for item in prompt):
        return [_from_ids(tokenizer, prompt)]
    return [_from_text(tokenizer, item, add_special_tokens) if isinstance(item, str) else _from_ids(tokenizer, item)
            for item in prompt]


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                tools: list[ToolDefinition] = (), call_format: str = "hermes", continue_final_message: bool = False,
                template_kwargs: Mapping[str, Any] | None = None, add_special_tokens: bool = False) -> Prompt:
    """The messages (and the tools the model may call) rendered with the model's chat template; a template that
    fails is the request's 400. `call_format`: the format of tool calls (`tool_call_format`).
    `continue_final_message`: the prompt ends with the final message's text, its turn left open (`ChatRendering`
    checks that it is an assistant's). `template_kwargs`: the template's other variables. `add_special_tokens`:
    the BOS the model's tokenizer asks for is added where the rendered text does not begin with it (a template
    that writes it gets no second one); otherwise the special tokens are the template's alone, as vLLM's default."""
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools]
    form = _message_form(tokenizer)
    uses_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
    try:
        if uses_tools and renders_tools(tokenizer):
            calls_in_content = call_format == "granite" and not writes_calls(tokenizer)
            template_messages = [_template_message(m, form, call_format, calls_in_content) for m in messages]
            template_tools = tool_dicts or None
        else:
            template_messages, template_tools = _default_messages(messages, tool_dicts, form), None
        if continue_final_message:
            final = template_messages[-1]["content"]
            template_messages[-1]["content"] = _followed_by(final, _CONTINUE_TAG)
        rendered = tokenizer.apply_chat_template(template_messages, add_generation_prompt=add_generation_prompt,
                                                 tools=template_tools, template_kwargs=template_kwargs)
    except ChatTemplateError as error:
        raise invalid_request(str(error), param="messages") from None
    if continue_final_message:
        rendered = _open_final_turn(rendered, final)
    return _from_text(tokenizer, rendered, add_special_tokens)


def _open_final_turn(rendered: str, final: str | list[dict[str, str]]) -> str:
    """The rendered chat cut where the final message's content `final` ends, so what closes its turn is gone. As
    Hugging Face's `continue_final_message`: at the `_CONTINUE_TAG` the final message was rendered with (its own
    text, not an earlier copy of it), the text's trailing whitespace dropped where the template trimmed the tag's."""
    text = final if isinstance(final, str) else final[-1]["text"]
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0 or text.strip() not in rendered:
        raise invalid_request("the chat template does not write the final message's text, so it cannot be "
                              "continued", param="continue_final_message")
    return rendered[:at] if rendered.startswith(_CONTINUE_TAG, at) else rendered[:at].rstrip()


@lru_cache(maxsize=4)
def renders_tools(tokenizer: Tokenizer) -> bool:
    """Whether the model's template shows the tools it is given (as llama.cpp decides: it renders a probe)."""
    try:
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False,
                                              tools=[_PROBE_TOOL])
    except ChatTemplateError:
        return False
    return _PROBE_TOOL["function"]["name"] in probe


@lru_cache(maxsize=4)
def writes_calls(tokenizer: Tokenizer) -> bool:
    """Whether the model's template writes an assistant's calls it is given (a probe's name in the rendering). One
    that fails on the probe is given calls as it is, and fails or not on the request's own."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}]
    try:
        probe = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=[_PROBE_TOOL])
    except ChatTemplateError:
        return True
    return _PROBE_CALL["function"]["name"] in probe


def tool_call_format(flag: str, tokenizer: Tokenizer) -> str:
    """The format the reply's calls are read in (`--tool-call-parser`). A template without tools gets Hermes,
    whatever the flag: the default prompt teaches it. Otherwise the flag's, and for "auto" the template's own:
    Granite's if it is Granite's (`_is_granites`), Mistral's if it writes `[TOOL_CALLS]`, Hermes if it writes
    `<tool_call>`, Llama 3's JSON if it has `<|python_tag|>` or asks for `"parameters"`, else Hermes."""
    if not renders_tools(tokenizer):
        return "hermes"
    if flag != "auto":
        return flag
    template = tokenizer.special.chat_template or ""
    if _is_granites(template):
        return "granite"
    if tool_calls.MISTRAL.open in template:
        return "mistral"
    if tool_calls.OPEN not in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def _is_granites(template: str) -> bool:
    """Whether `template` is Granite 3.x's: it asks for `<|tool_call|>` in Granite's roles (`<|start_of_role|>`,
    on which llama.cpp keys Granite's templates) and writes no Hermes call (`</tool_call>`, as Granite 4's do). The
    marker alone is no sign: another template may name it, in a comment say."""
    return (tool_calls.GRANITE.open in template and "<|start_of_role|>" in template
            and tool_calls.CLOSE not in template)


@lru_cache(maxsize=4)
def _reads_content_parts(tokenizer: Tokenizer) -> bool:
    """Whether the model's template loops over a message's content parts, vLLM's "openai" content format as its
    `_detect_content_format` finds it: a `for` over `m.content` (or `m['content']`) where `m` is a `for`'s over the
    messages (or a variable set from them), or a `for` over a variable named `content`."""
    template = tokenizer.special.chat_template
    if not template:
        return False
    try:
        root = compile_chat_template(template).environment.parse(template)
    except ChatTemplateError:
        return False
    loops = [loop for loop in root.find_all(nodes.For) if isinstance(loop.target, nodes.Name)]
    messages = _names_set_from(root, "messages")
    message_names = {loop.target.name for loop in loops if _reads(loop.iter, messages)}
    return any(_reads(loop.iter, message_names, "content")
               or (isinstance(loop.iter, nodes.Name) and loop.iter.name == "content") for loop in loops)


def _names_set_from(root: nodes.Template, name: str) -> set[str]:
    """`name` and the variables a `{% set %}` makes of it (or of one made of it), whole, sliced or filtered."""
    names, pending = {name}, [name]
    while pending:
        source = pending.pop()
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _reads(assign.node, {source}):
                names.add(target.name)
                pending.append(target.name)
    return names


def _reads(node: nodes.Node | None, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of the variables `names` (with `key`: its `key` item or attribute), filtered, tested or
    sliced."""
    while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                           and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        is_key = (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key
                  or isinstance(node, nodes.Getattr) and node.attr == key)
        node = node.node if is_key else None
    return isinstance(node, nodes.Name) and node.name in names


@dataclass(frozen=True)
class _MessageForm:
    """How the model's template is given messages: `roles` maps a message's role to the one the template is
    given; `content_parts`: a message's text parts go as they are (`_reads_content_parts`), not joined into one."""

    roles: Mapping[str, str]
    content_parts: bool


def _message_form(tokenizer: Tokenizer) -> _MessageForm:
    """The form the model's template reads messages in. OpenAI's newer "developer" role means system to a template
    that does not name it, as vLLM converts it; one that does (gpt-oss's) gets it as it is, as Hugging Face's."""
    template = tokenizer.special.chat_template or ""
    names_developer = '"developer"' in template or "'developer'" in template
    roles = {"system": "system", "developer": "developer" if names_developer else "system", "user": "user",
             "assistant": "assistant", "tool": "tool"}
    return _MessageForm(roles, _reads_content_parts(tokenizer))


def _content(message: ChatMessage, form: _MessageForm) -> str | list[dict[str, str]]:
    """The message's content as the template is given it: its text, or for a template that reads content parts, its
    text parts (a refusal one too) as vLLM gives them. A string stays one, as Hugging Face's; a tool's result is its
    text, as vLLM's (templates write it whole)."""
    if not (form.content_parts and isinstance(message.content, list)) or message.role == "tool":
        return message.text()
    texts = [part.text for part in message.content] + ([message.refusal] if message.refusal else [])
    return [{"type": "text", "text": text} for text in texts]


def _followed_by(content: str | list[dict[str, str]], text: str) -> str | list[dict[str, str]]:
    """`content` with `text` after it: at the end of its last part where it is parts (where Hugging Face's
    `continue_final_message` puts its tag)."""
    if isinstance(content, str):
        return content + text
    if not content:
        return [{"type": "text", "text": text}]
    return [*content[:-1], {**content[-1], "text": content[-1]["text"] + text}]


def _template_message(message: ChatMessage, form: _MessageForm, call_format: str,
                      calls_in_content: bool = False) -> dict[str, Any]:
    """The message as the template is given it, in the `form` it reads; `calls_in_content`: its calls are also
    written after its text, in the format `call_format` (for a template that does not write them)."""
    call_id = tool_calls.mistral_call_id if call_format == "mistral" else str
    rendered: dict[str, Any] = {"role": form.roles[message.role], "content": _content(message, form),
                                **_reasoning(message)}
    if message.tool_calls:
        calls = _calls(message)
        rendered["tool_calls"] = [{"id": call_id(call.id), "type": "function",
                                   "function": {"name": name, "arguments": arguments}}
                                  for call, (name, arguments) in zip(message.tool_calls, calls)]
        if calls_in_content:
            rendered["content"] = _followed_by(rendered["content"], tool_calls.render_calls(calls, call_format))
    if message.role == "tool":
        rendered["tool_call_id"] = call_id(message.tool_call_id)
    return rendered | _name(message)


def _calls(message: ChatMessage) -> list[tuple[str, Any]]:
    """The assistant's calls as (name, arguments) pairs, the arguments parsed."""
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


def _name(message: ChatMessage) -> dict[str, str]:
    """The message's `name` for the template, as vLLM passes it (a template may write who spoke)."""
    return {} if message.name is None else {"name": message.name}


def _reasoning(message: ChatMessage) -> dict[str, str]:
    if message.reasoning_content is None:
        return {}
    return {"reasoning_content": message.reasoning_content, "reasoning": message.reasoning_content}


def _default_messages(messages: list[ChatMessage], tools: list[dict[str, Any]],
                      form: _MessageForm) -> list[dict[str, Any]]:
    """Plain system/user/assistant messages (in the `form` the template reads) for a template without tools: the
    tools prompt joins the system message (or becomes one), calls are written into the assistant's text, and a run
    of tool results is one user message."""
    rendered: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            result = tool_calls.render_results([message.text()])
            if i > 0 and messages[i - 1].role == "tool":
                rendered[-1]["content"] += "\n" + result
            else:
                rendered.append({"role": "user", "content": result})
            continue
        content = _content(message, form)
        if message.tool_calls:
            calls = tool_calls.render_calls(_calls(message))
            content = _followed_by(content, f"\n{calls}") if message.text() else calls
        rendered.append({"role": form.roles[message.role], "content": content, **_reasoning(message),
                         **_name(message)})
    if tools:
        prompt = tool_calls.tools_prompt(tools)
        if rendered and rendered[0]["role"] == "system":  # /tokenize's messages may be none
            rendered[0]["content"] = _followed_by(rendered[0]["content"], f"\n\n{prompt}")
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def truncated(tokenizer: Tokenizer, prompt: Prompt, keep: int | None, max_model_len: int) -> Prompt:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: `max_model_len`); None: all of it."""
    if keep is None:
        return prompt
    keep = max_model_len if keep == -1 else keep
    if len(prompt.token_ids) <= keep:
        return prompt
    return _from_ids(tokenizer, prompt.token_ids[-keep:])


def truncated_prompts(tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]], keep: int | None,
                      max_model_len: int, add_special_tokens: bool = True) -> list[Prompt]:
    """`completion_prompts`, each `truncated`."""
    return [truncated(tokenizer, p, keep, max_model_len)
            for p in completion_prompts(tokenizer, prompt, add_special_tokens)]


def _from_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> Prompt:
    return Prompt(tokenizer.encode(text, add_special_tokens=add_special_tokens), text)


def _from_ids(tokenizer: Tokenizer, ids: list[int]) -> Prompt:
    # Special tokens' text kept: the echo is then the prompt, as the same prompt written out (and vLLM's) echoes.
    return Prompt(list(ids), tokenizer.decode(ids, skip_special_tokens=False))
