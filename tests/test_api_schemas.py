"""Request validation: what the API accepts, and the 400 (field path as `param`) for what it does not."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sluice.app.embeddings_schemas import EmbeddingRequest
from sluice.app.errors import APIError, from_validation_error, sent_path
from sluice.app.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from sluice.batching.sampling_params import StructuredOutput

VOCAB = {"vocab_size": 1000}

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def rejection(schema, body: dict) -> APIError:
    with pytest.raises(ValidationError) as caught:
        schema.model_validate(body, context=VOCAB)
    error = from_validation_error(caught.value, body)
    assert error.status == 400 and error.type == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", -1), ("max_tokens", 0), ("temperature", 2.5), ("temperature", -0.1), ("top_p", 0.0),
     ("top_logprobs", 21), ("n", 0), ("n", 65), ("presence_penalty", 3.0), ("stop", 7), ("top_k", -2),
     ("seed", -(2**63) - 1), ("seed", 2**64), ("stop_token_ids", [1000]), ("stop_token_ids", [-1]),
     ("stop_token_ids", list(range(17))), ("stop", ["x"] * 17), ("min_tokens", -1), ("stop_token_ids", [True]),
     ("stop_token_ids", ["5"])],
)
def test_out_of_range_chat_field_is_rejected_with_its_name_as_param(field, value):
    error = rejection(ChatCompletionRequest, {**CHAT, field: value, "logprobs": True})
    assert error.param is not None and error.param.startswith(field)


@pytest.mark.parametrize("prompt", [[True, 5], [[5, False]], ["x", 5]])
def test_a_prompt_of_anything_but_token_ids_or_strings_is_rejected(prompt):
    assert rejection(CompletionRequest, {"prompt": prompt}).param.startswith("prompt")


def test_unknown_role_is_rejected_and_names_the_message():
    error = rejection(ChatCompletionRequest, {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]})
    assert error.param == "messages.0.role"


def test_empty_messages_are_rejected():
    assert rejection(ChatCompletionRequest, {**CHAT, "messages": []}).param == "messages"


def test_top_logprobs_without_logprobs_is_rejected():
    rejection(ChatCompletionRequest, {**CHAT, "top_logprobs": 3})


def test_stream_options_without_stream_is_rejected():
    rejection(ChatCompletionRequest, {**CHAT, "stream_options": {"include_usage": True}})


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 - 1])
def test_seed_takes_openais_signed_64_bit_range_and_any_unsigned_one(seed):
    body = ChatCompletionRequest.model_validate({**CHAT, "seed": seed})
    assert body.sampling_params(default_max_tokens=8).seed == seed


@pytest.mark.parametrize("stop", ["", ["END", ""]])
def test_an_empty_stop_string_is_rejected_rather_than_ending_every_reply_at_once(stop):
    for schema, body in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "x"})):
        assert rejection(schema, {**body, "stop": stop}).param == "stop"


def test_null_fields_mean_their_defaults():
    body = ChatCompletionRequest.model_validate({**CHAT, "temperature": None, "stop": None, "n": None})
    params = body.sampling_params(default_max_tokens=8)
    assert (params.temperature, params.stop, params.n) == (1.0, (), 1)


def test_max_completion_tokens_wins_over_max_tokens():
    body = ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5, "max_completion_tokens": 9})
    assert body.max_new_tokens == 9


def test_content_parts_are_joined_as_text():
    body = ChatCompletionRequest.model_validate(
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )
    assert body.messages[0].text() == "a\nb"


def test_non_text_content_parts_are_rejected_by_their_type():
    error = rejection(ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert error.param == "messages.0.content" and "'image_url' are not supported" in error.message


@pytest.mark.parametrize(("choice", "words"), [
    ({"type": "custom", "custom": {"name": "f"}}, "of type 'custom'"),
    ({"type": "function", "name": "f"}, '{"type": "function", "function": {"name": ...}}'),
])
def test_a_tool_choice_object_other_than_a_named_function_is_refused_by_what_it_is(choice, words):
    """Not by the union's failed branches: it was "tool_choice.str: Input should be a valid string", with
    "tool_choice.str" as its param."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    error = rejection(ChatCompletionRequest, {**CHAT, "tools": tools, "tool_choice": choice})
    assert error.param == "tool_choice" and words in error.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "hi", "reasoning": "x"}]}, "messages.0.reasoning"),
    ({"messages": [{"role": "tool", "tool_call_id": "c", "content": "1", "reasoning_content": "x"}]},
     "messages.0.reasoning_content"),
    ({"messages": [{"role": "assistant", "content": "hi", "reasoning": 5}]}, "messages.0.reasoning"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),  # the str member's
    ({"stop": 5}, "stop"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": 5}, "tool_choice"),
])
def test_a_param_is_the_fields_path_as_the_client_sent_it(fields, param):
    """Not with the labels pydantic gives a union's members (its tag: `response_format.json_schema.json_schema.name`,
    or its type: `stop.str`), nor under another name of the field (`reasoning_content` for the `reasoning` sent)."""
    error = rejection(ChatCompletionRequest, {**CHAT, **fields})
    assert error.param == param and error.message.startswith(f"{param}: ")


@pytest.mark.parametrize(("loc", "body", "named", "path"), [
    (("a", "text", "citations"), {"a": {"type": "text", "text": "hi", "citations": 5}}, False, ("a", "citations")),
    (("a", "text", "text"), {"a": {"type": "text", "text": 5}}, False, ("a", "text")),
    (("a", "str"), {"a": {"b": 1}}, False, ("a",)),
    (("a", "str"), {"a": {}}, False, ("a",)),
    (("a", "message"), {"a": {"role": "user"}}, False, ("a",)),  # a union member's own check, under its tag
    (("a", "list[int]", 1), {"a": [0, "x"]}, False, ("a", 1)),
    (("a", "x", "b"), {"a": {}}, True, ("a", "b")),  # missing
    (("a", "b"), {"a": {}}, True, ("a", "b")),  # a cross-field check's, about a field left out
    (("a", "b"), "not what was validated", False, ("a", "b")),
])
def test_a_location_is_read_in_the_body_keeping_its_own_field_where_a_tag_is_also_a_key(loc, body, named, path):
    assert sent_path(loc, body, named) == path


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}])
def test_a_functions_parameters_of_another_type_than_object_are_refused_as_openai_refuses_them(parameters):
    """A call forced to such a function could only be read as none: its markup went out as the message's text."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    error = rejection(ChatCompletionRequest, {**CHAT, "tools": tools, "tool_choice": "required"})
    assert error.param == "tools.0.function.parameters" and "'type: \"object\"'" in error.message
    for open_schema in ({}, {"properties": {"a": {"type": "integer"}}}):  # no type: an object as ever
        ChatCompletionRequest.model_validate({**CHAT, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": open_schema}}]})


def test_a_past_calls_empty_arguments_are_no_arguments():
    """As vLLM reads them: some servers stream a call of a function without parameters with arguments "", and an
    agent sends the history back as it got it (it was a 400)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": ""}}
    body = ChatCompletionRequest.model_validate({**CHAT, "messages": [
        *CHAT["messages"], {"role": "assistant", "tool_calls": [call]}]})
    assert body.messages[1].tool_calls[0].function.arguments == "{}"


@pytest.mark.parametrize("arguments", ["[]", "1", "{", "  ", '{"a": NaN}', '{"a": -Infinity}'])
def test_a_past_calls_arguments_that_are_no_object_are_rejected(arguments):
    call = {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": arguments}}
    error = rejection(ChatCompletionRequest, {**CHAT, "messages": [{"role": "assistant", "tool_calls": [call]}]})
    assert error.param == "messages.0.tool_calls.0.function.arguments"


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_takes_all_four_openai_forms(prompt):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize(("prompt", "named"), [("", "prompt"), ([], "prompt"), ([[]], "prompt[0]"),
                                              ([[1], []], "prompt[1]"), (["a", ""], "prompt[1]")])
def test_empty_completion_prompt_is_rejected_naming_which(prompt, named):
    assert rejection(CompletionRequest, {"prompt": prompt}).message == f"prompt: {named} must not be empty"


def test_completion_logprobs_above_twenty_are_rejected():
    assert rejection(CompletionRequest, {"prompt": "x", "logprobs": 21}).param == "logprobs"


def test_a_completion_of_no_tokens_needs_echo():
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0, "echo": True}).max_tokens == 0
    assert rejection(CompletionRequest, {"prompt": "x", "max_tokens": 0}).message.endswith("needs echo (the prompt is "
                                                                                          "then the whole answer)")


def test_echo_with_logprobs_or_vllms_prompt_logprobs_ask_for_the_prompts_logprobs_but_not_streamed():
    def scored(**fields) -> int | None:
        return CompletionRequest.model_validate({"prompt": "x", **fields}).sampling_params(16).prompt_logprobs

    assert (scored(echo=True, logprobs=2), scored(logprobs=2), scored(prompt_logprobs=0)) == (2, None, 0)
    assert scored(echo=True, logprobs=1, prompt_logprobs=3) == 3  # the engine keeps the more alternatives
    assert ChatCompletionRequest.model_validate({**CHAT, "prompt_logprobs": 4}).sampling_params(16).prompt_logprobs == 4
    rejection(ChatCompletionRequest, {**CHAT, "prompt_logprobs": 1, "stream": True})
    rejection(CompletionRequest, {"prompt": "x", "prompt_logprobs": 21})


def test_sampling_params_carry_every_request_field():
    body = ChatCompletionRequest.model_validate(
        {**CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5,
         "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 7, "stop": "END", "n": 2,
         "ignore_eos": True, "min_tokens": 3, "stop_token_ids": [5], "max_tokens": 20, "logprobs": True,
         "top_logprobs": 4, "skip_special_tokens": False, "include_stop_str_in_output": True,
         "logit_bias": {"7": 1.5}}
    )
    params = body.sampling_params(default_max_tokens=99)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 40, 0.05)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (params.seed, params.stop, params.n, params.ignore_eos) == (7, ("END",), 2, True)
    assert (params.max_tokens, params.min_tokens, params.stop_token_ids) == (20, 3, (5,))
    assert (params.logprobs, params.top_logprobs, params.skip_special_tokens) == (True, 4, False)
    assert (params.include_stop_str_in_output, params.logit_bias) == (True, ((7, 1.5),))


def test_default_max_tokens_applies_only_without_a_limit():
    assert ChatCompletionRequest.model_validate(CHAT).sampling_params(default_max_tokens=99).max_tokens == 99
    completion = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2})
    params = completion.sampling_params()  # none needed: its field has the API's 16
    assert (params.max_tokens, params.logprobs, params.top_logprobs) == (16, True, 2)


@pytest.mark.parametrize("prompt", [[5, 1000], [[5], [1000]]])
def test_prompt_token_ids_outside_the_vocabulary_are_rejected(prompt):
    error = rejection(CompletionRequest, {"prompt": prompt})
    assert error.param == "prompt" and "1000" in error.message


def test_detokenize_ids_outside_the_vocabulary_are_rejected():
    assert rejection(DetokenizeRequest, {"tokens": [1, 1000]}).param == "tokens"


@pytest.mark.parametrize(
    ("schema", "field", "value"),
    [(ChatCompletionRequest, "functions", [{"name": "f"}]),
     (ChatCompletionRequest, "function_call", "auto"),
     (CompletionRequest, "best_of", 3),
     (CompletionRequest, "suffix", "the end")],
)
def test_fields_that_would_change_the_output_but_are_not_implemented_are_named_in_a_400(schema, field, value):
    body = {**CHAT} if schema is ChatCompletionRequest else {"prompt": "x"}
    error = rejection(schema, {**body, field: value})
    assert error.param == field and "not supported" in error.message


@pytest.mark.parametrize("bias", [{"x": 1}, {"5": 100.5}, {"1000": 1}, {str(i): 1 for i in range(301)}])
def test_logit_bias_takes_at_most_300_ids_of_the_vocabulary_with_biases_within_100(bias):
    assert rejection(ChatCompletionRequest, {**CHAT, "logit_bias": bias}).param.startswith("logit_bias")


def test_logit_bias_keys_become_token_ids_the_last_of_a_repeated_id_winning():
    request = ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"9": -100, "3": 2.5, "03": 1}})
    assert request.sampling_params(16).logit_bias == ((3, 1.0), (9, -100.0))


def test_harmless_forms_of_unimplemented_fields_are_accepted():
    ChatCompletionRequest.model_validate({**CHAT, "tool_choice": "none", "response_format": {"type": "text"},
                                          "logit_bias": {}, "tools": []})
    CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "suffix": ""})


@pytest.mark.parametrize(("fields", "structured"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}},
     StructuredOutput("json_schema", '{"type": "integer"}')),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_schema", '{"type": "object"}')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_schema", '{"type": "object"}')),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, StructuredOutput("json_schema", '{"type": "string"}')),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput("choice", '["a", "b"]')),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutput("grammar", 'start: "x"')),
    ({"response_format": {"type": "text"}}, None),
])
def test_response_format_and_structured_outputs_become_the_engines_grammar(fields, structured):
    for schema, body in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "x"})):
        request = schema.model_validate({**body, **fields}, context=VOCAB)
        assert request.sampling_params(default_max_tokens=8).structured == structured


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    {"structured_outputs": {}},
    {"structured_outputs": {"choice": []}},
    {"structured_outputs": {"regex": "a"}, "min_tokens": 2},
    {"response_format": {"type": "json_object"}, "ignore_eos": True},
    {"guided_regex": "a+"},
])
def test_conflicting_or_unknown_structured_output_fields_are_rejected(fields):
    rejection(ChatCompletionRequest, {**CHAT, **fields})


@pytest.mark.parametrize("fields", [
    {"bad_words": ["x"]}, {"use_beam_search": True},
    {"length_penalty": 0.5}, {"chat_template": "{{ messages }}"}, {"echo": True},
])
def test_vllm_fields_sluice_does_not_implement_are_refused_by_name_unless_left_at_their_default(fields):
    [(name, value)] = fields.items()
    error = rejection(ChatCompletionRequest, {**CHAT, **fields})
    assert f"{name} is not supported" in error.message
    if name not in ("chat_template", "echo"):  # chat's own; a completion's echo is OpenAI's
        rejection(CompletionRequest, {"prompt": "hi", **fields})
    default = {"bad_words": [], "use_beam_search": False, "length_penalty": 1.0, "echo": False}
    if name in default:
        ChatCompletionRequest.model_validate({**CHAT, name: default[name]}, context=VOCAB)
    ChatCompletionRequest.model_validate({**CHAT, name: None}, context=VOCAB)


def test_truncate_prompt_tokens_keeps_at_least_one_token():
    assert CompletionRequest.model_validate({"prompt": "hi", "truncate_prompt_tokens": -1}).truncate_prompt_tokens == -1
    for value in (0, -2):
        rejection(CompletionRequest, {"prompt": "hi", "truncate_prompt_tokens": value})


def test_allowed_token_ids_reach_the_engine_once_each_and_are_checked_against_the_vocabulary():
    body = {**CHAT, "allowed_token_ids": [5, 3, 5], "logit_bias": {"3": 2}}
    params = ChatCompletionRequest.model_validate(body, context=VOCAB).sampling_params(16)
    assert params.allowed_token_ids == (5, 3) and params.biased_ids == ((5, 0.0), (3, 2.0))
    for bad in ([], [VOCAB["vocab_size"]]):
        rejection(ChatCompletionRequest, {**CHAT, "allowed_token_ids": bad})


def test_priority_reaches_the_engine():
    assert ChatCompletionRequest.model_validate({**CHAT, "priority": -3}).sampling_params(16).priority == -3


@pytest.mark.parametrize("grammar", [{"tool_choice": "required"}, {"tool_choice": {"type": "function",
                                     "function": {"name": "f"}}}, {"thinking_token_budget": 8}])
def test_allowed_token_ids_are_refused_where_a_grammar_decides_the_tokens(grammar):
    """A forced call's grammar or a thinking budget's, as structured output's: the two could leave no token (the
    engine then ended the choice in an error, which the client saw as a 500)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    error = rejection(ChatCompletionRequest, {**CHAT, "tools": tools, "allowed_token_ids": [5], **grammar})
    assert "allowed_token_ids cannot be combined" in error.message
    ChatCompletionRequest.model_validate({**CHAT, "tools": tools, "allowed_token_ids": [5]}, context=VOCAB)


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize(("schema", "body", "param"), [
    (ChatCompletionRequest, {**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    (ChatCompletionRequest, {**CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (ChatCompletionRequest, {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    (ChatCompletionRequest, {**CHAT, "response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    (ChatCompletionRequest, {**CHAT, "structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
    (ChatCompletionRequest, {**CHAT, "structured_outputs": {"regex": "a"}, "allowed_token_ids": [5]},
     "allowed_token_ids"),
    (ChatCompletionRequest, {**CHAT, "tools": TOOLS, "tool_choice": "required", "structured_outputs": {
        "regex": "a"}}, "tool_choice"),
    (ChatCompletionRequest, {**CHAT, "tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    (ChatCompletionRequest, {**CHAT, "thinking_token_budget": 8, "allowed_token_ids": [5]}, "allowed_token_ids"),
    (ChatCompletionRequest, {**CHAT, "use_beam_search": True}, "use_beam_search"),
    (ChatCompletionRequest, {**CHAT, "continue_final_message": True}, "continue_final_message"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user"}]}, "messages.0.content"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "x", "reasoning": "y"}]},
     "messages.0.reasoning"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (TokenizeRequest, {}, "prompt"),
])
def test_a_cross_field_rejection_names_the_field_it_is_about_as_param(schema, body, param):
    """As OpenAI names it; a model-level check's 400 had param null."""
    error = rejection(schema, body)
    assert error.param == param and error.message.startswith(f"{param}: ") and "Value error" not in error.message


def test_a_forced_tool_choice_takes_a_response_format_which_holds_only_a_text_answer():
    """As OpenAI's API: the forced reply is calls, and the response format would hold an answer it never has."""
    body = ChatCompletionRequest.model_validate({**CHAT, "tools": TOOLS, "tool_choice": "required",
                                                 "response_format": {"type": "json_object"}})
    assert body.forced_tools() and body.response_schema() == {"type": "object"}


def test_add_special_tokens_defaults_as_vllms_true_for_a_text_prompt_false_for_messages():
    assert CompletionRequest.model_validate({"prompt": "x"}).add_special_tokens is True
    assert ChatCompletionRequest.model_validate(CHAT).rendering()["add_special_tokens"] is False
    assert TokenizeRequest.model_validate({"prompt": "x"}).add_special_tokens is True
    assert TokenizeRequest.model_validate({"prompt": "x", "add_special_tokens": False}).add_special_tokens is False
    assert TokenizeRequest.model_validate({"messages": CHAT["messages"]}).add_special_tokens is False
    assert EmbeddingRequest.model_validate({"input": "x"}).add_special_tokens is True
    assert EmbeddingRequest.model_validate({"input": "x", "add_special_tokens": False}).add_special_tokens is False
