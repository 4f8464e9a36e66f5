"""Chat messages -> prompt through the model's chat template (`app/prompts.py`), on SmolLM2's real tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from sluice.app.cli import CommandError, generate_prompt_ids
from sluice.app.errors import APIError
from sluice.app.prompts import chat_prompt, truncated_prompts
from sluice.app.schemas import ChatCompletionRequest, ChatMessage
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


# Loop over a message's content parts where it has them, as Gemma 3's, Llama 4's and Mistral Small's templates do
# (the second through a variable set from the messages, as Llama 3.2 Vision's).
READS_PARTS = ["{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
               "{% for part in m.content %}<{{ part.text }}>{% endfor %}{% endif %}|{% endfor %}",
               "{% set turns = messages[0:] %}{% for m in turns %}{{ m.role }}:{% if m['content'] is string %}"
               "{{ m['content'] }}{% else %}{% for part in m['content'] | list %}<{{ part['text'] }}>{% endfor %}"
               "{% endif %}|{% endfor %}"]


@pytest.mark.parametrize("template", READS_PARTS)
def test_a_template_that_loops_over_content_parts_gets_the_text_parts_as_they_are(tokenizer, template):
    """vLLM's "openai" content format, which it finds in the template, and Hugging Face's for the same messages; a
    string content stays a string, as Hugging Face's."""
    reads_parts = with_special(tokenizer, chat_template=template)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    request = chat([{"role": "user", "content": parts}, {"role": "assistant", "content": "Hi"}])
    assert chat_prompt(reads_parts, request.messages).text == "user:<one><two>|assistant:Hi|"
    opened = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": parts}],
                  add_generation_prompt=False, continue_final_message=True)
    assert chat_prompt(reads_parts, opened.messages, **opened.rendering()).text == "user:Hi|assistant:<one><two"


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


def chat(messages: list[dict], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def test_continue_final_message_ends_the_prompt_inside_the_assistants_text(tokenizer):
    request = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! I am"}],
                   add_generation_prompt=False, continue_final_message=True)
    opened = chat_prompt(tokenizer, request.messages, **request.rendering())
    answered = chat_prompt(tokenizer, [user("Hi")])
    assert opened.text == answered.text + "Hello! I am"  # no end of turn after it
    # A template that trims messages: the stripped text is the one it wrote.
    trims = with_special(tokenizer, chat_template="{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}")
    padded = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Sure, "}],
                  add_generation_prompt=False, continue_final_message=True)
    assert chat_prompt(trims, padded.messages, **padded.rendering()).text == "[Hi][Sure,"
    hides = with_special(tokenizer, chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(APIError) as raised:
        chat_prompt(hides, padded.messages, **padded.rendering())
    assert (raised.value.status, raised.value.param) == (400, "continue_final_message")


def test_continue_final_message_ends_the_prompt_at_the_final_messages_own_text_not_an_earlier_copy(tokenizer):
    """Hugging Face's: the cut is where the final message's text ends as the template wrote it; the same text in
    an earlier message, written whole where the final one is trimmed, is no place to cut."""
    trims_replies = with_special(tokenizer, chat_template="{% for m in messages %}[{{ m.content if m.role == 'user' "
                                                          "else m.content | trim }}]{% endfor %}")
    request = chat([{"role": "user", "content": "Sure "}, {"role": "assistant", "content": "Sure "}],
                   add_generation_prompt=False, continue_final_message=True)
    assert chat_prompt(trims_replies, request.messages, **request.rendering()).text == "[Sure ][Sure"


@pytest.mark.parametrize("fields, message", [
    ({"continue_final_message": True}, "cannot both be true"),
    ({"continue_final_message": True, "add_generation_prompt": False, "final": "user"}, "final assistant message"),
    ({"continue_final_message": True, "add_generation_prompt": False, "final": "  "}, "final assistant message"),
    ({"chat_template_kwargs": {"messages": []}}, "messages cannot be set here"),
    ({"chat_template_kwargs": {"namespace": 1, "tools": []}}, "namespace, tools cannot be set here"),
])
def test_rendering_fields_that_cannot_be_honoured_are_refused(fields, message):
    final = fields.pop("final", "Sure")
    last = {"role": "user", "content": "Hi"} if final == "user" else {"role": "assistant", "content": final}
    with pytest.raises(ValidationError, match=message):
        chat([{"role": "user", "content": "Hi"}, last], **fields)


def test_chat_template_kwargs_are_the_templates_variables(tokenizer):
    thinks = with_special(tokenizer, chat_template=(
        "{{ messages[0]['content'] }}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"))
    for kwargs, expected in (({}, "Hi"), ({"enable_thinking": False}, "Hi /no_think")):
        request = chat([{"role": "user", "content": "Hi"}], chat_template_kwargs=kwargs)
        assert chat_prompt(thinks, request.messages, **request.rendering()).text == expected


def test_documents_reach_the_template_defined_even_when_none_were_given(tokenizer):
    """vLLM's `documents` field, for templates that write them (Granite's, Command R's); Hugging Face's
    apply_chat_template always passes `documents` (None by default), so `documents is defined` holds without them.
    chat_template_kwargs' documents come instead, as vLLM merges them last."""
    rag = with_special(tokenizer, chat_template=(
        "{% if documents is defined %}{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% else %}undefined{% endif %}{{ messages[0]['content'] }}"))
    docs = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    for fields, expected in (({}, "Hi"), ({"documents": docs}, "[a: one][b: two]Hi"),
                             ({"documents": docs, "chat_template_kwargs": {"documents": docs[1:]}}, "[b: two]Hi")):
        request = chat([{"role": "user", "content": "Hi"}], **fields)
        assert chat_prompt(rag, request.messages, **request.rendering()).text == expected


# Reads an assistant's reasoning as Qwen3's and DeepSeek-R1's templates do; shows the tools it is given.
THINKS = ("{% for t in tools or [] %}{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}:"
          "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}")
TOOL = {"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
@pytest.mark.parametrize("tools", [[], [TOOL]])
def test_an_assistants_reasoning_reaches_the_template_as_reasoning_content(tokenizer, field, tools):
    request = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", field: "greet"},
                    {"role": "user", "content": "Bye"}], tools=tools)
    rendered = chat_prompt(with_special(tokenizer, chat_template=THINKS), request.messages,
                           tools=request.active_tools()).text
    assert rendered.endswith("user:Hi|assistant:<think>greet</think>Hello|user:Bye|")


@pytest.mark.parametrize(("tool_choice", "exclude", "shown", "callable_"), [
    ("auto", False, "look;", ["look"]), ("auto", True, "look;", ["look"]),
    ("none", False, "look;", []), ("none", True, "", []),
])
def test_tool_choice_none_shows_the_template_the_tools_unless_excluded_and_calls_none(tokenizer, tool_choice, exclude,
                                                                                      shown, callable_):
    """vLLM's since 0.10: the model knows the tools with tool_choice "none" too, but no call is read from its reply;
    --exclude-tools-when-tool-choice-none leaves them out of the prompt."""
    request = chat([{"role": "user", "content": "Hi"}], tools=[TOOL], tool_choice=tool_choice)
    rendered = chat_prompt(with_special(tokenizer, chat_template=THINKS), request.messages,
                           tools=request.active_tools(exclude)).text
    assert rendered == f"{shown}user:Hi|"
    assert [tool.function.name for tool in request.callable_tools()] == callable_


def test_the_template_sees_the_reasoning_under_vllms_other_name_too(tokenizer):
    reads_reasoning = with_special(tokenizer, chat_template="{{ messages[1].reasoning }}")
    request = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning": "greet"}])
    assert chat_prompt(reads_reasoning, request.messages).text == "greet"


def test_a_template_that_does_not_read_reasoning_renders_as_without_it(tokenizer):
    def rendered(assistant: dict) -> str:
        return chat_prompt(tokenizer, chat([{"role": "user", "content": "Hi"}, assistant]).messages).text

    assert rendered({"role": "assistant", "content": "Hello", "reasoning_content": "greet"}) == rendered(
        {"role": "assistant", "content": "Hello"})


def test_an_assistant_message_may_be_reasoning_alone_and_only_an_assistants_has_reasoning():
    thought = chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning": "greet"}]).messages[1]
    assert (thought.text(), thought.reasoning_content) == ("", "greet")
    with pytest.raises(ValidationError, match="only assistant messages have reasoning"):
        chat([{"role": "user", "content": "Hi", "reasoning_content": "greet"}])


def test_a_messages_name_reaches_the_template_as_vllm_passes_it(tokenizer):
    names = with_special(tokenizer, chat_template="{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }})"
                                                  "{% endif %}:{{ m.content }}|{% endfor %}")
    request = chat([{"role": "developer", "content": "Be brief", "name": "ops"},
                    {"role": "user", "content": "Hi", "name": "bob"}, {"role": "assistant", "content": "Hello"}])
    assert chat_prompt(names, request.messages).text == "system(ops):Be brief|user(bob):Hi|assistant:Hello|"


@pytest.mark.parametrize("tools", [[], [TOOL]])
def test_a_developer_message_stays_one_for_a_template_that_names_the_role(tokenizer, tools):
    """As Hugging Face passes it, and vLLM where the template names "developer" (gpt-oss's writes it apart from a
    system message); a template that does not name it gets a system message."""
    request = chat([{"role": "developer", "content": "Be brief"}, {"role": "user", "content": "Hi"}], tools=tools)
    shown = "look;" if tools else ""
    for template, role in ((THINKS + "{# knows 'developer' #}", "developer"), (THINKS, "system")):
        rendered = chat_prompt(with_special(tokenizer, chat_template=template), request.messages,
                               tools=request.active_tools()).text
        assert rendered == f"{shown}{role}:Be brief|user:Hi|"


def test_a_chats_special_tokens_are_its_templates_unless_add_special_tokens_asks_for_the_bos(tokenizer):
    """vLLM's chat default (false): a BOS the template does not write is not added; true adds it, once."""
    plain = with_special(tokenizer, add_bos=True, chat_template="{{ messages[0]['content'] }}")

    def ids(**fields) -> list[int]:
        request = chat([{"role": "user", "content": "Hi"}], **fields)
        return chat_prompt(plain, request.messages, **request.rendering()).token_ids

    assert ids() == tokenizer.encode("Hi")
    assert ids(add_special_tokens=True) == [tokenizer.bos_token_id, *tokenizer.encode("Hi")]


def test_add_special_tokens_never_doubles_a_bos_the_template_writes(tokenizer):
    """SmolLM2's BOS is <|im_start|>, which its ChatML template writes first: with its tokenizer asking for a BOS,
    the prompt is the same either way."""
    asks_bos = with_special(tokenizer, add_bos=True)
    request = chat([{"role": "user", "content": "Hi"}], add_special_tokens=True)
    prompt = chat_prompt(asks_bos, request.messages, **request.rendering())
    assert prompt.token_ids == chat_prompt(tokenizer, request.messages).token_ids
    assert prompt.token_ids[0] == tokenizer.bos_token_id != prompt.token_ids[1]


def test_a_completions_text_prompt_gets_the_bos_unless_add_special_tokens_is_false_and_ids_stay_as_they_are(tokenizer):
    asks_bos = with_special(tokenizer, add_bos=True)
    hi = tokenizer.encode("Hi")
    for add_special_tokens, expected in ((True, [tokenizer.bos_token_id, *hi]), (False, hi)):
        prompts = truncated_prompts(asks_bos, ["Hi", hi], None, 128, add_special_tokens)
        assert [p.token_ids for p in prompts] == [expected, hi]


def test_sluice_generate_renders_a_chat_as_the_server_does_and_a_plain_prompt_with_the_bos(tokenizer):
    """`sluice generate --chat` added the BOS the tokenizer asks for on top of the template's (a doubled BOS where
    the template writes it), where a served chat takes the template's special tokens alone."""
    asks_bos = with_special(tokenizer, add_bos=True)
    assert generate_prompt_ids(asks_bos, "Hi", chat=True) == chat_prompt(tokenizer, [user("Hi")]).token_ids
    assert generate_prompt_ids(asks_bos, "Hi", chat=False) == [tokenizer.bos_token_id, *tokenizer.encode("Hi")]
    with pytest.raises(CommandError, match="^--chat: "):
        generate_prompt_ids(with_special(tokenizer, chat_template="{{ raise_exception('no') }}"), "Hi", chat=True)


def test_no_messages_with_tools_render_the_tools_prompt_alone(tokenizer):
    """/tokenize takes an empty list of messages, and tools with it (a fuzzer's 500: the tools prompt went into a
    first message that was not there)."""
    tools = chat([{"role": "user", "content": "Hi"}], tools=[TOOL]).tools
    rendered = chat_prompt(tokenizer, [], tools=tools).text
    assert rendered.startswith("<|im_start|>system\n") and "look" in rendered
