"""The OpenAI Agents SDK (`openai-agents`) against a real `sluice serve` with SmolLM2: an agent with a function tool
runs its loop (the model calls the tool, the SDK runs it and sends its output back, the model answers) over the
Responses API and over Chat Completions, whole and streamed, a triage agent hands the question off to it, an
agent's output type is structured output, and a second user turn carries the first's items."""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel
from agents import (Agent, HandoffCallItem, HandoffOutputItem, MessageOutputItem, ModelSettings,
                    OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, RunResult, RunResultStreaming,
                    ToolCallItem, ToolCallOutputItem, function_tool, set_tracing_disabled)

from test_api_e2e import API_KEY, start_server

MODEL = "smollm2-agents"
FLAGS = ["--skip-server-warmup", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--max-model-len", "2048",
         "--kv-cache-memory", "96MiB", "--api-key", API_KEY, "--served-model-name", MODEL, "--no-ui"]
MODELS = {"responses": OpenAIResponsesModel, "chat_completions": OpenAIChatCompletionsModel}

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI


@pytest.fixture(scope="module")
def server():
    proc = start_server(*FLAGS)
    yield proc
    proc.stop()


# A call is required first (the SDK lets the model choose after one), greedy.
SETTINGS = ModelSettings(tool_choice="required", temperature=0, max_tokens=300)


def model(server, api: str) -> OpenAIResponsesModel | OpenAIChatCompletionsModel:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    return MODELS[api](MODEL, client)


def weather_agent(server, api: str, asked: list[str]) -> Agent:
    """An agent that must call `get_weather` first."""

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        asked.append(city)
        return f"Sunny, 24 C in {city}"

    return Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                 model=model(server, api), model_settings=SETTINGS, handoff_description="Knows the weather.")


async def run(agent: Agent, prompt: str | list, stream: bool, max_turns: int = 3, **options
              ) -> RunResult | RunResultStreaming:
    """`options`: the Runner's (`previous_response_id`, ...)."""
    if not stream:
        return await Runner.run(agent, prompt, max_turns=max_turns, **options)
    result = Runner.run_streamed(agent, prompt, max_turns=max_turns, **options)
    async for _ in result.stream_events():
        pass
    return result


def assert_called_the_tool_then_answered(result: RunResult | RunResultStreaming, asked: list[str]) -> None:
    calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert asked and all(isinstance(city, str) and city for city in asked)
    assert len(calls) == len(asked) and outputs == [f"Sunny, 24 C in {city}" for city in asked]
    assert isinstance(result.new_items[-1], MessageOutputItem)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.context_wrapper.usage.requests >= 2  # the call, then (after any more) the answer to its output


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", MODELS)
def test_an_agent_calls_its_tool_and_answers_from_its_output(server, api, stream):
    asked: list[str] = []
    result = asyncio.run(run(weather_agent(server, api, asked), "What is the weather in Paris?", stream))
    assert_called_the_tool_then_answered(result, asked)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", MODELS)
def test_a_triage_agent_hands_off_to_the_weather_agent_which_calls_its_tool_and_answers(server, api, stream):
    """The handoff is a function tool of the SDK's (`transfer_to_weather`), which the triage agent must call."""
    asked: list[str] = []
    weather = weather_agent(server, api, asked)
    one_handoff = SETTINGS.resolve(ModelSettings(parallel_tool_calls=False))  # a second is the SDK's tool output
    triage = Agent(name="triage", instructions="Hand weather questions to the weather agent.", handoffs=[weather],
                   model=model(server, api), model_settings=one_handoff)
    result = asyncio.run(run(triage, "What is the weather in Paris?", stream, max_turns=5))
    kinds = [type(item) for item in result.new_items]
    assert kinds.index(HandoffCallItem) < kinds.index(HandoffOutputItem) < kinds.index(ToolCallItem)
    assert result.last_agent is weather
    assert_called_the_tool_then_answered(result, asked)


class Forecast(BaseModel):
    city: str
    sunny: bool


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", MODELS)
def test_an_agents_output_type_is_structured_output_its_final_output_parses_to(server, api, stream):
    """The SDK sends the type's strict JSON schema (`response_format`, `text.format`), which the grammar holds to."""
    agent = Agent(name="forecaster", instructions="Answer in JSON.", output_type=Forecast, model=model(server, api),
                  model_settings=ModelSettings(temperature=0, max_tokens=60))
    result = asyncio.run(run(agent, "It is sunny in Paris. Which city, and is it sunny?", stream))
    assert isinstance(result.final_output, Forecast) and result.final_output.city


@pytest.mark.parametrize("api", MODELS)
def test_a_second_turn_sends_the_first_turns_calls_and_outputs_back(server, api):
    asked: list[str] = []
    agent = weather_agent(server, api, asked)

    async def two_turns() -> tuple[list, RunResult]:
        history = (await run(agent, "What is the weather in Paris?", stream=False)).to_input_list()
        del asked[:]
        return history, await run(agent, [*history, {"role": "user", "content": "And in Rome?"}], stream=False)

    history, second = asyncio.run(two_turns())
    assert {item.get("type") for item in history} >= {"function_call", "function_call_output"}
    assert_called_the_tool_then_answered(second, asked)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_run_chained_by_previous_response_id_sends_only_its_new_items_and_goes_on(server, stream):
    """The SDK's server-side conversation state (`auto_previous_response_id`): each request after the first names the
    response before it and sends what came since (the tool's output, a 400 without the call the named response
    holds; then the next user turn)."""
    asked: list[str] = []
    agent = weather_agent(server, "responses", asked)

    async def two_turns() -> RunResult | RunResultStreaming:
        first = await run(agent, "What is the weather in Paris?", stream, auto_previous_response_id=True)
        assert_called_the_tool_then_answered(first, asked)
        del asked[:]
        return await run(agent, "And in Rome?", stream, previous_response_id=first.last_response_id)

    assert_called_the_tool_then_answered(asyncio.run(two_turns()), asked)


def test_a_history_with_a_reasoning_models_reasoning_items_goes_on_over_the_responses_api(server):
    """A conversation another (reasoning) model began: its reasoning items come back with the rest (the SDK's
    chat completions model leaves them out itself, for any model but DeepSeek's)."""
    asked: list[str] = []
    agent = weather_agent(server, "responses", asked)
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Use the tool."}]}

    async def two_turns() -> RunResult:
        history = (await run(agent, "What is the weather in Paris?", stream=False)).to_input_list()
        del asked[:]
        first_call = next(i for i, item in enumerate(history) if item.get("type") == "function_call")
        history.insert(first_call, reasoning)
        return await run(agent, [*history, {"role": "user", "content": "And in Rome?"}], stream=False)

    assert_called_the_tool_then_answered(asyncio.run(two_turns()), asked)
