"""Embeddings: the engine's pooling against the model's own forward pass, batched, chunked, preempted and cached;
then `POST /v1/embeddings` through the official `openai` client (tiny random model in-process, and SmolLM2)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from sluice.app.embeddings import normalized
from sluice.app.server import create_app
from sluice.app.state import ServerSettings, ServerState
from sluice.batching.config import EngineConfig
from sluice.batching.engine import Engine
from sluice.batching.outputs import Increment
from sluice.batching.sampling_params import SamplingParams
from sluice.model.config import ModelConfig
from sluice.model.generate import contiguous_attend
from sluice.model.llama import Llama, empty_kv_cache
from sluice.model.loader import LoadedModel

TINY = ModelConfig.tiny(vocab_size=49152)  # SmolLM2's tokenizer's: text inputs are encoded with it
PAGE = 4
CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, page_size=PAGE,
                      kv_cache_memory=256 * 2 * TINY.num_layers * TINY.num_kv_heads * PAGE * TINY.head_dim * 4,
                      num_decode_steps=4, warmup=False)
LONG = [(7 * i) % 250 + 3 for i in range(100)]  # over three steps' budget of 32 tokens


@pytest.fixture(scope="module")
def tiny(smollm2) -> LoadedModel:
    """The tiny random model, with SmolLM2's tokenizer."""
    return LoadedModel(TINY, Llama(TINY, rngs=nnx.Rngs(0)), smollm2.tokenizer, "tiny")


@pytest.fixture(scope="module")
def engine(tiny) -> Engine:
    return Engine(tiny, CONFIG, progress=False)


class Sink:
    def __init__(self) -> None:
        self.increments: list[Increment] = []

    def put(self, increment: Increment) -> None:
        self.increments.append(increment)


def submit(engine: Engine, prompts: list[list[int]], pooling: str, request_id: str) -> Sink:
    sink = Sink()
    engine.submit(prompts, SamplingParams(max_tokens=0, temperature=0.0, pooling=pooling), sink, request_id)
    return sink


def run(engine: Engine) -> None:
    while engine.has_work:
        engine.step()


def vectors(sink: Sink) -> list[np.ndarray]:
    by_choice = {i.choice: i for i in sink.increments}
    assert all(i.finish_reason == "stop" and i.embedding is not None for i in by_choice.values())
    return [normalized(by_choice[c].embedding) for c in sorted(by_choice)]


def embed(engine: Engine, prompts: list[list[int]], pooling: str, request_id: str = "embed") -> list[np.ndarray]:
    sink = submit(engine, prompts, pooling, request_id)
    run(engine)
    return vectors(sink)


def reference(model: Llama, ids: list[int], pooling: str) -> np.ndarray:
    """The model's forward pass over one contiguous cache, with the final norm and pooling in numpy (float64)."""
    cache = empty_kv_cache(model.config, num_pages=1, page_size=len(ids), dtype=model.dtype)
    attend = contiguous_attend(jnp.int32(0), model.config.softmax_scale)
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32), cache, attend)
    h = np.asarray(hidden, np.float64)
    normed = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + model.config.rms_norm_eps)
    normed *= np.asarray(model.final_norm[...], np.float64)
    pooled = normed[-1] if pooling == "last" else normed.mean(axis=0)
    return pooled / np.linalg.norm(pooled)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooling_equals_the_models_own_forward_pass_for_short_and_chunked_prompts(tiny, engine, pooling):
    prompts = [[5, 6, 7], [9], LONG]
    for got, ids in zip(embed(engine, prompts, pooling), prompts):
        np.testing.assert_allclose(got, reference(tiny.model, ids, pooling), atol=1e-5)


def test_last_and_mean_pooling_differ(engine):
    [last], [mean] = embed(engine, [LONG], "last"), embed(engine, [LONG], "mean")
    assert float(last @ mean) < 0.99


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_batch_of_inputs_pools_each_as_it_pools_alone(engine, pooling):
    prompts = [LONG[i:i + n] for i, n in [(0, 3), (5, 40), (2, 17), (30, 1), (11, 64)]]
    alone = [embed(engine, [p], pooling)[0] for p in prompts]
    together = embed(engine, prompts, pooling)
    np.testing.assert_allclose(together, alone, atol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_prompt_over_the_step_budget_pools_as_in_one_step(tiny, engine, pooling):
    one_step = Engine(tiny, replace(CONFIG, max_num_batched_tokens=128), progress=False)
    np.testing.assert_allclose(embed(engine, [LONG], pooling), embed(one_step, [LONG], pooling), atol=1e-5)


def test_embeddings_batched_with_generation_change_neither(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [[alone]] = engine.generate([LONG[:20]], greedy)
    expected = embed(engine, [LONG, LONG[:9]], "mean")
    generating = Sink()
    engine.submit([LONG[:20]], greedy, generating, "generate")
    pooling = submit(engine, [LONG, LONG[:9]], "mean", "embed")
    run(engine)
    np.testing.assert_allclose(vectors(pooling), expected, atol=1e-5)
    assert tuple(t for i in generating.increments for t in i.token_ids) == alone.token_ids


def test_preempted_embeddings_recompute_and_pool_as_alone(tiny):
    small = Engine(tiny, replace(CONFIG, kv_cache_memory=CONFIG.kv_cache_memory * 20 // 256, max_model_len=80),
                   progress=False)
    prompts = [LONG[i:i + 60] for i in range(0, 40, 10)]
    alone = [embed(small, [p], "mean")[0] for p in prompts]
    preemptions = small.scheduler.num_preemptions
    np.testing.assert_allclose(embed(small, prompts, "mean"), alone, atol=1e-5)
    assert small.scheduler.num_preemptions > preemptions
    assert small.stats.kv_pages_used == 0


@pytest.mark.parametrize("pooling, cached", [("last", True), ("mean", False)])
def test_last_pooling_reuses_cached_pages_and_mean_pooling_recomputes_them(engine, pooling, cached):
    first = embed(engine, [LONG], pooling, "first")
    sink = submit(engine, [LONG], pooling, "second")
    run(engine)
    np.testing.assert_allclose(vectors(sink), first, atol=1e-5)
    assert (sink.increments[-1].usage.cached_prompt_tokens > 0) == cached


def test_an_aborted_embedding_leaves_no_pages(engine):
    submit(engine, [LONG, LONG[3:]], "mean", "aborted")
    engine.step()
    assert engine.stats.kv_pages_used > 0
    engine.abort("aborted")
    run(engine)
    assert engine.stats.kv_pages_used == 0


# --- POST /v1/embeddings --------------------------------------------------------------------------------------


def serve(engine: Engine, scenario, **settings):
    """Runs `scenario(client, http)` against the app: `client` the official AsyncOpenAI, `http` raw httpx."""

    async def run_app():
        state = ServerState(ServerSettings(**settings))
        state.set_engine(engine)
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://sluice", timeout=120) as http:
                client = openai.AsyncOpenAI(base_url="http://sluice/v1", api_key="unused", http_client=http,
                                            max_retries=0)
                return await scenario(client, http)
        finally:
            await engine.shutdown()

    return asyncio.run(run_app())


def test_the_openai_client_gets_unit_vectors_as_floats_and_as_base64(engine):
    texts = ["The river carved a valley.", "Stock markets fell sharply today."]

    async def scenario(client, http):
        floats = await client.embeddings.create(model="tiny", input=texts, encoding_format="float")
        packed = await client.embeddings.create(model="tiny", input=texts)  # the client asks for base64
        raw = await http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"})
        return floats, packed, raw.json()

    floats, packed, raw = serve(engine, scenario)
    assert floats.object == "list" and floats.model == "tiny" and [d.index for d in floats.data] == [0, 1]
    got = np.array([d.embedding for d in floats.data])
    assert got.shape == (2, TINY.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(np.array([d.embedding for d in packed.data], np.float32), got.astype(np.float32))
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, got[0].astype(np.float32))
    num_tokens = sum(len(engine.tokenizer.encode(t)) for t in texts)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens


def test_token_ids_embed_as_their_text_and_truncated_as_their_last_tokens_and_pages_return_to_idle(engine):
    text = "Hello there, embeddings."
    ids = engine.tokenizer.encode(text)

    async def scenario(client, http):
        by_text = await client.embeddings.create(model="tiny", input=text, encoding_format="float")
        by_ids = await client.embeddings.create(model="tiny", input=[ids, ids[-3:]], encoding_format="float",
                                                dimensions=TINY.hidden_size)
        cut = await client.embeddings.create(model="tiny", input=text, encoding_format="float",
                                             extra_body={"truncate_prompt_tokens": 3})
        return by_text, by_ids, cut

    by_text, by_ids, cut = serve(engine, scenario)
    np.testing.assert_allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-6)
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    np.testing.assert_allclose(cut.data[0].embedding, by_ids.data[1].embedding, atol=1e-6)
    assert cut.usage.prompt_tokens == 3
    assert engine.stats.kv_pages_used == 0


def test_a_batch_of_as_many_inputs_as_langchain_sends_embeds_each_in_input_order(engine):
    texts = ["alpha", "bravo charlie", "delta echo foxtrot", "golf"]
    inputs = [texts[i % 4] for i in range(1000)]  # LangChain's OpenAIEmbeddings sends 1000 inputs a request

    async def scenario(client, http):
        alone = await client.embeddings.create(model="tiny", input=texts)
        return alone, await client.embeddings.create(model="tiny", input=inputs)

    alone, batch = serve(engine, scenario)
    assert [d.index for d in batch.data] == list(range(len(inputs)))
    expected = np.array([alone.data[i % 4].embedding for i in range(len(inputs))])
    np.testing.assert_allclose(np.array([d.embedding for d in batch.data]), expected, atol=1e-5)
    assert batch.usage.prompt_tokens == 250 * alone.usage.prompt_tokens


def test_a_request_larger_than_the_whole_queue_is_served_when_nothing_else_is_in_flight(engine):
    inputs = [f"item {i}" for i in range(CONFIG.max_num_seqs + 4 + 8)]  # past the running batch and the queue

    async def scenario(client, http):
        return await client.embeddings.create(model="tiny", input=inputs)

    reply = serve(engine, scenario, max_waiting=4)
    assert [d.index for d in reply.data] == list(range(len(inputs)))


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [TINY.vocab_size]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 32}, "dimensions"),
    ({"input": [5] * 129}, "input"),  # past the context
    ({"input": ["a"] * 2049}, "input"),
    ({"input": [[5]] * 2049}, "input"),
])
def test_bad_inputs_are_openai_shaped_400s(engine, body, param):
    async def scenario(client, http):
        return await http.post("/v1/embeddings", json=body)

    response = serve(engine, scenario)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param or (param is not None and error["param"].startswith(param))


@pytest.mark.slow
def test_smollm2_gives_the_same_text_twice_cosine_similarity_one(smollm2):
    engine = Engine(smollm2, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                          kv_cache_memory=64 << 20, warmup=False), progress=False)
    text = "Sluice serves embeddings from the same engine as generation."

    async def scenario(client, http):
        first = await client.embeddings.create(model="SmolLM2", input=text, encoding_format="float")
        second = await client.embeddings.create(model="SmolLM2", input=[text, "An unrelated sentence."])
        return first, second

    first, second = serve(engine, scenario, served_model_name="SmolLM2")
    a, b, other = (np.array(v, np.float64) for v in
                   (first.data[0].embedding, second.data[0].embedding, second.data[1].embedding))
    assert a.shape == (smollm2.config.hidden_size,)
    assert abs(float(a @ b) - 1.0) < 1e-5 and float(a @ other) < 0.999
