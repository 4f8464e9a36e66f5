"""pydantic-ai and LangChain, the agent frameworks users most often point at an OpenAI-compatible server, against a
real `sluice serve` with SmolLM2, over its three APIs (Chat Completions, the Responses API, Anthropic's Messages):
a pydantic-ai agent calls its function tool and answers from its output, whole and streamed; its structured output
type arrives validated, as an output tool or as native structured output; LangChain's bound tools give tool calls
(streamed: chunks that assemble into them) whose ToolMessage the model answers; its structured output parses; a
prompt too long for the context is the error each framework tells an overflow by.

No call here counts tokens: LangChain's `get_num_tokens*` would fetch tiktoken's encodings from the internet."""

from __future__ import annotations

import asyncio
import operator
from functools import reduce

import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.exceptions import ContextOverflowError
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import Runnable
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from pydantic_ai import Agent, NativeOutput, RunContext
from pydantic_ai.exceptions import ModelContextWindowExceededError
from pydantic_ai.messages import ModelMessage, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models import Model
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.profiles.anthropic import anthropic_model_profile
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from test_api_e2e import API_KEY, start_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-frameworks"
FLAGS = ["--skip-server-warmup", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--max-model-len", "2048",
         "--kv-cache-memory", "96MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui"]
APIS = ("chat", "responses", "anthropic")
QUESTION = "What is the weather in Paris?"
FORECAST_QUESTION = "It is sunny in Paris. Which city, and is it sunny?"
TOO_LONG = "word " * 2048  # a token a word: more than the context window holds


@pytest.fixture(scope="module")
def server():
    proc = start_server(*FLAGS)
    yield proc
    proc.stop()


class Forecast(BaseModel):
    city: str
    sunny: bool


def weather(city: str) -> str:
    return f"Sunny, 24 C in {city}"


# --- pydantic-ai --------------------------------------------------------------------------------


def pydantic_ai_model(server, api: str, **options) -> Model:
    """`api`: "chat", "responses" or "anthropic" (`/v1/messages`, which the anthropic client appends to the URL);
    `options`: the model's (`profile`, ...)."""
    if api == "anthropic":
        return AnthropicModel(MODEL, provider=AnthropicProvider(base_url=server.url, api_key=API_KEY), **options)
    model = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
    return model(MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key=API_KEY), **options)


# pydantic-ai drops `temperature` for Anthropic API versions after 2023-06-01 (its default is later), and the
# replies were then sampled at the model's default: a tool call's city once came back "". Greedy needs that version.
GREEDY = ModelSettings(temperature=0, extra_headers={"anthropic-version": "2023-06-01"})


def call_then_answer(ctx: RunContext) -> ModelSettings:
    """A call is required first, then none (pydantic-ai refuses a static `tool_choice="required"`, which would
    leave the agent no way to finish), one call at a time, greedy."""
    return ModelSettings(**GREEDY, tool_choice="required" if ctx.run_step == 1 else "none", parallel_tool_calls=False,
                         max_tokens=200)


def weather_agent(server, api: str, asked: list[str]) -> Agent:
    agent = Agent(pydantic_ai_model(server, api), instructions="Answer with the weather tool.",
                  model_settings=call_then_answer)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        asked.append(city)
        return weather(city)

    return agent


async def run(agent: Agent, stream: bool) -> tuple[str, list[ModelMessage]]:
    """The run's output and messages; streamed, the output is the text's deltas joined."""
    if not stream:
        result = await agent.run(QUESTION)
        return result.output, result.all_messages()
    async with agent.run_stream(QUESTION) as result:
        output = "".join([delta async for delta in result.stream_text(delta=True)])
    return output, result.all_messages()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
def test_a_pydantic_ai_agent_calls_its_tool_and_answers_from_its_output(server, api, stream):
    asked: list[str] = []
    output, messages = asyncio.run(run(weather_agent(server, api, asked), stream))
    parts = [part for message in messages for part in message.parts]
    calls = [part for part in parts if isinstance(part, ToolCallPart)]
    returns = [part.content for part in parts if isinstance(part, ToolReturnPart)]
    assert len(asked) == 1 and asked[0]
    assert [(call.tool_name, call.args_as_dict()) for call in calls] == [("get_weather", {"city": asked[0]})]
    assert returns == [weather(asked[0])]
    assert isinstance(parts[-1], TextPart) and output == parts[-1].content and output.strip()


@pytest.mark.parametrize(("api", "native"), [("chat", False), ("responses", False), ("anthropic", False),
                                             ("chat", True), ("responses", True), ("anthropic", True)],
                         ids=["chat-tool", "responses-tool", "anthropic-tool", "chat-native", "responses-native",
                              "anthropic-native"])
def test_a_pydantic_ai_output_type_arrives_validated_as_an_output_tool_or_native_structured_output(server, api,
                                                                                                   native):
    """An output tool is a forced call (`tool_choice` required, `any` on Anthropic's API); native output is
    `response_format` json_schema, `text.format` or `output_config.format`, which pydantic-ai sends only to the
    models it knows can take it: on Anthropic's API, Claude's."""
    claude = {"profile": anthropic_model_profile("claude-sonnet-4-5")} if native and api == "anthropic" else {}
    agent = Agent(pydantic_ai_model(server, api, **claude), output_type=NativeOutput(Forecast) if native else Forecast,
                  instructions="Answer in JSON.", model_settings=ModelSettings(**GREEDY, max_tokens=100))
    result = asyncio.run(agent.run(FORECAST_QUESTION))
    assert isinstance(result.output, Forecast) and result.output.city
    called = {part.tool_name for message in result.all_messages() for part in message.parts
              if isinstance(part, ToolCallPart)}
    assert called == (set() if native else {"final_result"})


@pytest.mark.parametrize("api", APIS)
def test_a_prompt_too_long_for_the_context_is_pydantic_ais_context_window_error(server, api):
    """Told from other 400s by OpenAI's code `context_length_exceeded` or Anthropic's words "prompt is too long"."""
    with pytest.raises(ModelContextWindowExceededError):
        asyncio.run(Agent(pydantic_ai_model(server, api)).run(TOO_LONG))


# --- LangChain ----------------------------------------------------------------------------------


@tool("get_weather")
def get_weather_tool(city: str) -> str:
    """The current weather of a city."""
    return weather(city)


def chat_model(server, api: str) -> BaseChatModel:
    """Greedy; `api` as pydantic_ai_model's."""
    if api == "anthropic":
        return ChatAnthropic(base_url=server.url, api_key=API_KEY, model=MODEL, temperature=0, max_tokens=200,
                             max_retries=0, timeout=300)
    return ChatOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, model=MODEL, temperature=0, max_tokens=200,
                      max_retries=0, timeout=300, use_responses_api=api == "responses")


def invoke(model: Runnable, messages: list[BaseMessage], stream: bool) -> AIMessage:
    """Streamed: the chunks added up, as LangChain assembles them (tool call chunks merged by index)."""
    return reduce(operator.add, model.stream(messages)) if stream else model.invoke(messages)


@pytest.mark.parametrize(("api", "stream"), [("chat", False), ("chat", True), ("responses", False),
                                             ("anthropic", False), ("anthropic", True)],
                         ids=["chat-whole", "chat-streamed", "responses-whole", "anthropic-whole",
                              "anthropic-streamed"])
def test_langchain_bound_tools_give_a_tool_call_whose_tool_message_the_model_answers(server, api, stream):
    model = chat_model(server, api)
    forced = model.bind_tools([get_weather_tool], tool_choice="get_weather", parallel_tool_calls=False)
    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    call = invoke(forced, messages, stream)
    assert [tool_call["name"] for tool_call in call.tool_calls] == ["get_weather"] and not call.invalid_tool_calls
    assert call.tool_calls[0]["args"]["city"]
    result = get_weather_tool.invoke(call.tool_calls[0])  # a ToolMessage answering the call's id
    answer = invoke(model.bind_tools([get_weather_tool]), [*messages, call, result], stream)
    assert not answer.tool_calls and answer.text.strip()


@pytest.mark.parametrize(("api", "method"), [("chat", "json_schema"), ("chat", "function_calling"),
                                             ("anthropic", "json_schema")])
def test_langchain_structured_output_parses_into_the_pydantic_model(server, api, method):
    """json_schema: `response_format` (Anthropic's: `output_config.format`); function_calling: a forced call."""
    structured = chat_model(server, api).with_structured_output(Forecast, method=method, include_raw=True)
    result = structured.invoke(FORECAST_QUESTION)
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Forecast) and result["parsed"].city
    assert bool(result["raw"].tool_calls) == (method == "function_calling")


@pytest.mark.parametrize("api", APIS)
def test_a_prompt_too_long_for_the_context_is_langchains_context_overflow_error(server, api):
    """Told by the words "prompt is too long", Anthropic's, which the OpenAI routes' message holds too: LangChain
    also looks for the code `context_length_exceeded` in the exception's text, where the openai client no longer
    puts the error's body."""
    with pytest.raises(ContextOverflowError):
        chat_model(server, api).invoke(TOO_LONG)
