"""The HTTP app over a real engine (the tiny random model, in-process): what the real server subprocess cannot
be made to do on purpose — a failing engine step — plus template errors and keep-alive comments while queued."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import httpx
import pytest
from flax import nnx

from sluice.app.dashboard.feed import Feed
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.model.config import ModelConfig
from sluice.model.llama import Llama
from sluice.model.loader import LoadedModel
from sluice.model.tokenizer import Tokenizer

TINY = ModelConfig.tiny()
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, page_size=4,
                      kv_cache_memory=1 << 20, num_decode_steps=1)


@pytest.fixture(scope="module")
def engine(smollm2) -> Engine:
    # The tokenizer's whole vocabulary, so that a request's grammar compiles (structured output needs every id).
    config = replace(TINY, vocab_size=smollm2.tokenizer.vocab_size)
    loaded = LoadedModel(config, Llama(config, rngs=nnx.Rngs(0)), smollm2.tokenizer, "tiny")
    return Engine(loaded, CONFIG, progress=False)


def serve(engine: Engine, scenario, **settings):
    """Runs `scenario(client, state)` against the app with the engine's step loop started."""

    async def run():
        state = ServerState(ServerSettings(**settings))
        state.set_engine(engine)
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://sluice", timeout=60) as client:
                return await scenario(client, state)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def fail_next_dispatch(engine: Engine, monkeypatch) -> None:
    real = engine.runner.dispatch

    def failing(*args):
        monkeypatch.setattr(engine.runner, "dispatch", real)
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "dispatch", failing)


COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_a_failed_step_ends_the_stream_with_an_error_event_and_the_server_serves_on(engine, monkeypatch):
    async def scenario(client, state):
        fail_next_dispatch(engine, monkeypatch)
        failed = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
        after = await client.post("/v1/completions", json=COMPLETION)
        return failed, after, state.metrics.render().decode()

    failed, after, metrics = serve(engine, scenario)
    assert failed.status_code == 200
    events = [e[len("data: "):] for e in failed.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected device fault" in error["message"]
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 6
    assert 'sluice_e2e_request_latency_seconds_count{outcome="error"} 1.0' in metrics


def test_a_failed_step_is_a_500_without_streaming(engine, monkeypatch):
    async def scenario(client, state):
        fail_next_dispatch(engine, monkeypatch)
        return await client.post("/v1/completions", json=COMPLETION)

    response = serve(engine, scenario)
    assert response.status_code == 500 and response.json()["error"]["code"] == "generation_error"


def test_a_chat_template_that_fails_is_a_400_naming_messages(smollm2):
    tokenizer = smollm2.tokenizer
    failing = Tokenizer.from_json(tokenizer.to_json(), replace(
        tokenizer.special, chat_template="{{ raise_exception('no system role here') }}"))
    loaded = LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), failing, "tiny")
    engine = Engine(loaded, replace(CONFIG, warmup=False), progress=False)  # no step runs: nothing to compile

    async def scenario(client, state):
        return await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})

    response = serve(engine, scenario)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages" and "no system role here" in error["message"]


def test_a_queued_stream_gets_keepalive_comments_before_its_first_token(engine):
    long = {"prompt": [9, 10, 11], "max_tokens": 100, "ignore_eos": True, "stream": True}

    async def scenario(client, state):
        busy = [asyncio.create_task(client.post("/v1/completions", json=long)) for _ in range(CONFIG.max_num_seqs)]
        await asyncio.sleep(0.05)
        queued = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        await asyncio.gather(*busy)
        return queued

    queued = serve(engine, scenario, sse_keepalive_s=0.005)
    events = queued.text.split("\n\n")
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert first_data > 0 and set(events[:first_data]) == {": keep-alive"}


def test_the_push_stream_sends_settings_and_history_first_then_one_sample_per_tick(engine):
    async def scenario(client, state):
        await client.post("/v1/completions", json=COMPLETION)
        feed = Feed(state)
        feed.tick()
        events = feed.events()
        first = await anext(events)
        await client.post("/v1/completions", json=COMPLETION)
        second = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0)
        feed.tick()
        return [json.loads(e.decode()[len("data: "):]) for e in (first, await second)]

    first, second = serve(engine, scenario, slo_ttft_ms=300.0)
    assert first["config"]["slo_ttft_ms"] == 300.0 and first["config"]["max_num_seqs"] == CONFIG.max_num_seqs
    assert len(first["history"]) == 1
    sample = second["sample"]
    assert sample["output_tps"] > 0 and sample["ttft_ms"] is not None and sample["e2e_ms"] is not None
    assert sum(second["live"]["decode_batch_histogram"]) > 0


def test_a_stream_that_fails_after_its_200_is_listed_among_the_dashboards_errors(engine, monkeypatch):
    async def scenario(client, state):
        fail_next_dispatch(engine, monkeypatch)
        await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        return state.metrics.recent.take().errors

    (error,) = serve(engine, scenario)
    assert (error.kind, error.status) == ("5xx", 500) and error.source.startswith("cmpl-")
    assert "injected device fault" in error.message


def test_a_model_is_retrieved_by_its_id_slash_included_and_any_other_id_is_a_404(engine):
    async def scenario(client, state):
        return [await client.get(f"/v1/models/{name}") for name in ("org/tiny-chat", "tiny")], \
            state.metrics.render().decode()

    (found, other), metrics = serve(engine, scenario, served_model_name="org/tiny-chat")
    assert found.status_code == 200
    card = found.json()
    assert card | {"created": 0, "created_at": ""} == {
        "id": "org/tiny-chat", "object": "model", "created": 0, "owned_by": "sluice",
        "max_model_len": CONFIG.max_model_len, "type": "model", "display_name": "org/tiny-chat", "created_at": "",
        "lifecycle": "active", "max_input_tokens": CONFIG.max_model_len - 1, "max_tokens": CONFIG.max_model_len - 1,
        "root": None, "parent": None}
    assert card["created_at"].endswith("Z")  # Anthropic's ModelInfo: RFC 3339
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert 'route="/v1/models/{model_id}",status="404"' in metrics


@pytest.mark.parametrize(("skip_special_tokens", "text"), [(True, ""), (False, "<|im_start|>")])
def test_skip_special_tokens_false_keeps_the_text_of_a_sampled_special_token(engine, skip_special_tokens, text):
    # The grammar makes the reply `<|im_start|>` (id 1) whatever the weights; EOS then ends it, unshown.
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "skip_special_tokens": skip_special_tokens,
            "structured_outputs": {"grammar": "start: <[1]>"}}

    async def scenario(client, state):
        return await client.post("/v1/completions", json=body)

    response = serve(engine, scenario)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, "stop")


@pytest.mark.parametrize("generation_config", ["auto", "vllm"])
def test_the_models_sampling_defaults_hold_where_a_request_leaves_a_field_out(engine, monkeypatch, generation_config):
    """With the model's defaults greedy and 3 tokens long, a completion without temperature or max_tokens decodes
    greedily, 16 tokens long (the completions API's own default, which the model's does not bound, as vLLM), an
    Anthropic message without temperature too, and a response reports the temperature it sampled at;
    `--generation-config vllm` keeps the APIs' own defaults (1.0, and 16 tokens)."""
    monkeypatch.setattr(engine, "generation_defaults", {"temperature": 0.0, "max_tokens": 3})
    message = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}

    async def scenario(client, state):
        completions = [await client.post("/v1/completions", json={"prompt": [5, 6, 7], "ignore_eos": True, **extra})
                       for extra in ({}, {"temperature": 0, "max_tokens": 3})]
        messages = [await client.post("/v1/messages", json={**message, **extra})
                    for extra in ({}, {}, {"temperature": 0})]
        responses = [await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, **extra})
                     for extra in ({}, {"temperature": 0.7})]
        return completions, messages, responses

    completions, messages, responses = serve(engine, scenario, generation_config=generation_config)
    left_out, greedy = (r.json()["choices"][0]["text"] for r in completions)
    texts = [r.json()["content"][0]["text"] for r in messages]
    temperatures = [r.json()["temperature"] for r in responses]
    if generation_config == "auto":
        assert left_out.startswith(greedy) and completions[0].json()["usage"]["completion_tokens"] == 16
        assert texts[0] == texts[1] == texts[2]
        assert temperatures == [0.0, 0.7]
    else:
        assert completions[0].json()["usage"]["completion_tokens"] == 16
        assert temperatures == [1.0, 0.7]


def test_the_engine_stops_when_the_apps_lifespan_ends_with_an_error(engine):
    """A host that ends the app's lifespan with an error (run-batch's driver when its run fails, a cancelled serve
    loop) still stops the engine: no step loop is left running."""

    async def run():
        state = ServerState(ServerSettings())
        state.set_engine(engine)
        await engine.start()
        app = create_app(state)
        with pytest.raises(RuntimeError, match="the host failed"):
            async with app.router.lifespan_context(app):
                raise RuntimeError("the host failed")

    asyncio.run(run())
    assert not [thread for thread in threading.enumerate() if thread.name == "sluice-engine"]


def test_sagemakers_invocations_answers_each_body_as_the_route_its_fields_name(engine):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    bodies = {"/v1/chat/completions": chat, "/v1/completions": COMPLETION, "/v1/embeddings": {"input": "Hi there"}}
    answer = {"/v1/chat/completions": "choices", "/v1/completions": "choices", "/v1/embeddings": "data"}

    async def scenario(client, state):
        pairs = {path: (await client.post(path, json=body), await client.post("/invocations", json=body))
                 for path, body in bodies.items()}
        streamed = await client.post("/invocations", json={**COMPLETION, "stream": True})
        bad_chat = await client.post("/invocations", json={**chat, "temperature": -1})
        neither = await client.post("/invocations", json={"max_tokens": 5})
        return pairs, streamed, bad_chat, neither

    pairs, streamed, bad_chat, neither = serve(engine, scenario)
    for path, (direct, invoked) in pairs.items():
        assert direct.status_code == invoked.status_code == 200, (path, invoked.text)
        assert direct.json()["object"] == invoked.json()["object"]
        assert direct.json()[answer[path]] == invoked.json()[answer[path]]
    assert streamed.headers["content-type"].startswith("text/event-stream")
    text = "".join(json.loads(event[len("data: "):])["choices"][0]["text"]
                   for event in streamed.text.split("\n\n") if event.startswith("data: {"))
    assert text == pairs["/v1/completions"][0].json()["choices"][0]["text"]
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "temperature"
    assert neither.status_code == 400 and "`messages`, `prompt`, `input`, `text_1`, `documents`" in (
        neither.json()["error"]["message"])


def test_invocations_answers_score_and_rerank_bodies_and_reads_a_null_field_as_absent(engine):
    score = {"text_1": "a cat", "text_2": ["a dog", "a car"]}
    rerank = {"query": "a cat", "documents": ["a dog", "a car"]}

    async def scenario(client, state):
        return [(await client.post(path, json=body), await client.post("/invocations", json=body))
                for path, body in [("/v1/score", score), ("/v1/rerank", rerank),
                                   ("/v1/embeddings", {"input": "Hi there", "prompt": None})]]

    for direct, invoked in serve(engine, scenario):
        assert direct.status_code == invoked.status_code == 200, invoked.text
        assert {key: value for key, value in direct.json().items() if key not in ("id", "created")} == {
            key: value for key, value in invoked.json().items() if key not in ("id", "created")}
