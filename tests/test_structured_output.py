"""Structured output on the real SmolLM2: JSON schemas, regex, choice and grammars hold in what the model writes,
offline and over the OpenAI API (the official client included), without changing unconstrained neighbours.
One engine for the module; HTTP goes through the app in-process."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.sampling_params import SamplingParams, StructuredOutput
from sluice.batching.structured import Grammar
from sluice.model.loader import LoadedModel

from test_server_engine import serve

pytestmark = pytest.mark.slow

PAGE_SIZE = 16
PAGE_BYTES = 2 * 30 * 3 * PAGE_SIZE * 64 * 4  # SmolLM2 float32
CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=384, kv_cache_memory=256 * PAGE_BYTES,
                      num_decode_steps=1, page_size=PAGE_SIZE, warmup=False)

CITY = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
    "required": ["name", "country", "population"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "role", "hobbies"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "fruit": {"type": "string", "maxLength": 16}, "price": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["fruit", "price"], "additionalProperties": False}},
    "paid": {"type": "boolean"}},
    "required": ["items", "paid"], "additionalProperties": False}
SCHEMAS = [("Describe a city in JSON.", CITY), ("Invent a person in JSON.", PERSON),
           ("Write a fruit order in JSON.", ORDER)]


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> Engine:
    return Engine(smollm2, CONFIG, progress=False)


def chat(engine: Engine, question: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def json_schema(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def test_json_schema_outputs_parse_and_validate_for_several_schemas_greedy_and_seeded(engine):
    prompts, params = [], []
    for question, schema in SCHEMAS:
        for sampling in (dict(temperature=0.0), dict(temperature=0.8, seed=11, n=2), dict(temperature=1.0, seed=5)):
            prompts.append(chat(engine, question))
            params.append(SamplingParams(max_tokens=160, structured=json_schema(schema), **sampling))
    outs = engine.generate(prompts, params)
    for (question, schema), group in zip(SCHEMAS, [outs[i:i + 3] for i in range(0, len(outs), 3)]):
        for completion in [c for choices in group for c in choices]:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)
    assert engine.stats.kv_pages_used == 0


def test_tokens_the_grammar_forces_skip_their_steps_and_change_no_token(engine, monkeypatch):
    prompts = [chat(engine, question) for question, _ in SCHEMAS]
    params = [SamplingParams(structured=json_schema(schema), **sampling)
              for (_, schema), sampling in zip(SCHEMAS, (dict(temperature=0.0, max_tokens=160),
                                                         dict(temperature=0.9, seed=4, max_tokens=160),
                                                         dict(temperature=0.0, max_tokens=30)))]

    def run() -> tuple[list[list[int]], int]:
        steps = engine.stats.num_steps
        outs = engine.generate(prompts, params)
        return [o[0].token_ids for o in outs], engine.stats.num_steps - steps

    forced, forced_steps = run()
    monkeypatch.setattr(Grammar, "forced_token", lambda self: None)
    stepwise, stepwise_steps = run()
    assert forced == stepwise
    assert forced_steps < 0.8 * stepwise_steps  # JSON's keys and punctuation: many positions allow one token
    assert engine.stats.kv_pages_used == 0


def test_unconstrained_requests_batched_with_constrained_ones_get_the_tokens_they_get_alone(engine):
    plain = [chat(engine, "Name three colors."), chat(engine, "What is the capital of France?")]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=24)
    alone = engine.generate(plain, [greedy, seeded])
    constrained = SamplingParams(temperature=0.0, max_tokens=60, structured=json_schema(PERSON))
    mixed = engine.generate([chat(engine, "Invent a person in JSON."), *plain, chat(engine, "Pick one.")],
                            [constrained, greedy, seeded,
                             SamplingParams(temperature=0.7, seed=2, max_tokens=8,
                                            structured=StructuredOutput("choice", '["red", "green"]'))])
    assert [m[0].token_ids for m in mixed[1:3]] == [a[0].token_ids for a in alone]
    assert mixed[3][0].text in ("red", "green")


def test_a_grammar_that_forbids_eos_until_complete_never_ends_early(engine):
    prompt = chat(engine, "Say OK and nothing else.")
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0][0]
    pattern = r"OK(, [a-z]+){4}\. Code [0-9]{6}\."
    spec = StructuredOutput("regex", pattern)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=80, structured=spec))[0][0]
    assert free.finish_reason == "stop" and len(free.token_ids) < len(out.token_ids)
    assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    cut = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(out.token_ids) - 3,
                                                   structured=spec))[0][0]
    assert cut.finish_reason == "length" and out.text.startswith(cut.text) and not re.fullmatch(pattern, cut.text)


async def post(client, path: str, body: dict):
    return await client.post(path, json={"max_tokens": 120, "temperature": 0, **body})


def test_response_format_json_schema_streamed_and_not_gives_the_same_valid_json(engine):
    body = {"messages": [{"role": "user", "content": "Describe a city in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}}

    async def scenario(client, state):
        whole = await post(client, "/v1/chat/completions", body)
        streamed = await post(client, "/v1/chat/completions", {**body, "stream": True})
        return whole, streamed

    whole, streamed = serve(engine, scenario)
    message = whole.json()["choices"][0]
    assert message["finish_reason"] == "stop"
    jsonschema.validate(json.loads(message["message"]["content"]), CITY)
    chunks = [json.loads(e[len("data: "):]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["message"]["content"]


def test_structured_outputs_regex_choice_grammar_and_json_object_hold_on_both_routes(engine):
    question = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    cases = [
        ("/v1/chat/completions", {**question, "structured_outputs": {"regex": r"[A-Z][a-z]{1,12}, [A-Z][a-z]{1,12}"}},
         lambda text: re.fullmatch(r"[A-Z][a-z]{1,12}, [A-Z][a-z]{1,12}", text)),
        ("/v1/chat/completions", {**question, "structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
         lambda text: text in ("Paris", "Lyon", "Nice")),
        ("/v1/completions", {"prompt": "The answer, yes or no:", "structured_outputs":
                             {"grammar": 'start: answer "."\nanswer: "yes" | "no"'}},
         lambda text: text in ("yes.", "no.")),
        ("/v1/completions", {"prompt": "A JSON object:", "response_format": {"type": "json_object"}},
         lambda text: isinstance(json.loads(text), dict)),
        ("/v1/chat/completions", {**question, "structured_outputs": {"json": json.dumps(CITY)}},
         lambda text: jsonschema.validate(json.loads(text), CITY) is None),
    ]

    async def scenario(client, state):
        return [await post(client, path, body) for path, body, _ in cases]

    for (path, _, holds), response in zip(cases, serve(engine, scenario)):
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" and holds(text), (path, text)


@pytest.mark.parametrize(("body", "problem"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}, "not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "strin"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "nowhere"),
    ({"structured_outputs": {"json": "{oops"}}, "JSON schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
    ({"response_format": {"type": "xml"}}, "xml"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
    # Past llguidance's limits, which show only as its first token is taken: refused, not failed mid-reply.
    ({"structured_outputs": {"choice": [f"option {i}" for i in range(2001)]}}, "choice too large"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
        "$ref": "#/$defs/n"}}}}, "JSON schema too large"),
])
def test_invalid_or_unsupported_structured_output_is_a_400_naming_the_problem(engine, body, problem):
    async def scenario(client, state):
        return await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **body})

    response = serve(engine, scenario)
    assert response.status_code == 400 and problem in response.json()["error"]["message"]
    assert engine.stats.num_requests_waiting == 0 and engine.stats.num_requests_running == 0


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)
    in_europe: bool


def test_the_openai_clients_parse_returns_a_parsed_pydantic_object(engine):
    async def scenario(client, state):
        api = openai.AsyncOpenAI(base_url="http://sluice/v1", api_key="unused", http_client=client)
        return await api.chat.completions.parse(
            model=engine.model_name, temperature=0, max_tokens=80, response_format=Capital,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])

    completion = serve(engine, scenario)
    parsed = completion.choices[0].message.parsed
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(parsed, Capital) and parsed.capital == "Paris"
