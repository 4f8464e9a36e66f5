"""vLLM's `/score` and `/rerank` routes over the embeddings: each pair's score is the cosine similarity of the
texts' `/v1/embeddings` vectors; rerank orders documents by it (tiny random model in-process)."""

from __future__ import annotations

import numpy as np
import pytest

from test_embeddings import TINY, engine, serve, tiny  # noqa: F401 (engine, tiny: fixtures)

QUERY = "Where do rivers begin?"
DOCUMENTS = ["Stock markets fell sharply today.", "Rivers begin at springs in the hills.", "A recipe for bread.",
             "Where do rivers begin?"]


def embeddings(http, texts: list[str]):
    """The unit vectors /v1/embeddings gives `texts`, as a [len(texts), D] array."""

    async def get():
        reply = await http.post("/v1/embeddings", json={"input": texts})
        return np.array([d["embedding"] for d in reply.json()["data"]])

    return get()


def post(engine, path: str, body: dict):
    """`body` posted to `path`, with the embeddings of every text in it; returns (response, {text: vector})."""
    texts = [t for key in ("text_1", "text_2", "query", "documents") for t in np.atleast_1d(body.get(key, []))]

    async def scenario(client, http):
        response = await http.post(path, json=body)
        return response, await embeddings(http, texts)

    response, vectors = serve(engine, scenario)
    return response, dict(zip(texts, vectors))


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize("text_1, text_2", [
    (QUERY, DOCUMENTS[1]),  # 1:1
    (QUERY, DOCUMENTS),  # 1:N
    ([QUERY, DOCUMENTS[0], DOCUMENTS[2]], DOCUMENTS[1:]),  # N:N
])
def test_a_score_is_the_cosine_of_the_two_texts_embeddings(engine, path, text_1, text_2):
    response, vectors = post(engine, path, {"text_1": text_1, "text_2": text_2, "model": "tiny"})
    assert response.status_code == 200, response.text
    reply = response.json()
    firsts, seconds = np.atleast_1d(text_1).tolist(), np.atleast_1d(text_2).tolist()
    pairs = list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds))
    assert reply["id"].startswith("score-") and reply["object"] == "list" and reply["model"] == "tiny"
    assert isinstance(reply["created"], int)
    assert [(d["index"], d["object"]) for d in reply["data"]] == [(i, "score") for i in range(len(pairs))]
    expected = [float(vectors[a] @ vectors[b]) for a, b in pairs]
    np.testing.assert_allclose([d["score"] for d in reply["data"]], expected, atol=1e-5)
    assert engine.stats.kv_pages_used == 0


def test_each_distinct_text_is_embedded_once_and_counted_once(engine):
    response, _ = post(engine, "/score", {"text_1": [QUERY, QUERY], "text_2": [QUERY, DOCUMENTS[0]]})
    reply = response.json()
    assert reply["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    num_tokens = sum(len(engine.tokenizer.encode(t)) for t in (QUERY, DOCUMENTS[0]))
    assert reply["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_score_keeping_their_input_indices(engine, path):
    response, vectors = post(engine, path, {"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    reply = response.json()
    scores = [float(vectors[QUERY] @ vectors[d]) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: scores[i], reverse=True)
    assert reply["id"].startswith("rerank-") and reply["model"] == "tiny"
    assert [r["index"] for r in reply["results"]] == order
    assert [r["document"] for r in reply["results"]] == [{"text": DOCUMENTS[i]} for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in reply["results"]], sorted(scores, reverse=True),
                               atol=1e-5)
    assert reply["results"][0]["index"] == 3  # the query itself
    assert reply["usage"]["total_tokens"] == sum(len(engine.tokenizer.encode(d)) for d in DOCUMENTS)
    assert engine.stats.kv_pages_used == 0


@pytest.mark.parametrize("top_n, returned", [(2, 2), (0, 4), (-1, 4), (9, 4)])
def test_top_n_cuts_the_ranking_to_its_best_documents(engine, top_n, returned):
    whole, _ = post(engine, "/rerank", {"query": QUERY, "documents": DOCUMENTS})
    cut, _ = post(engine, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": top_n})
    assert cut.json()["results"] == whole.json()["results"][:returned]


def test_return_documents_false_leaves_the_documents_out(engine):
    response, _ = post(engine, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert [r["document"] for r in response.json()["results"]] == [None] * len(DOCUMENTS)


def test_truncate_prompt_tokens_scores_each_texts_last_tokens(engine):
    tail = engine.tokenizer.decode(engine.tokenizer.encode(DOCUMENTS[1])[-3:])
    cut, _ = post(engine, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[1], "truncate_prompt_tokens": 3})
    alone, _ = post(engine, "/score", {"text_1": engine.tokenizer.decode(engine.tokenizer.encode(QUERY)[-3:]),
                                       "text_2": tail})
    assert cut.json()["data"][0]["score"] == pytest.approx(alone.json()["data"][0]["score"], abs=1e-5)


LONG = "word " * 200  # past the tiny engine's 128-token context


@pytest.mark.parametrize("path, body, param, message", [
    ("/score", {"text_1": [], "text_2": "a"}, "text_1", "At least one text element must be given"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "At least one text_pair element must be given"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2", "Input lengths must be either 1:1, 1:N or N:N"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "1:1, 1:N or N:N"),
    ("/score", {"text_1": "a", "text_2": ["b", ""]}, "text_2", "must not be empty"),
    ("/score", {"text_1": "a"}, "text_2", ""),
    ("/score", {"text_1": 5, "text_2": "a"}, "text_1", ""),
    ("/score", {"text_1": {"content": [{"type": "text", "text": "a"}]}, "text_2": "a"}, "text_1", "text only"),
    ("/score", {"text_1": "a", "text_2": ["b"] * 2049}, "text_2", "at most 2048"),
    ("/score", {"text_1": "a", "text_2": LONG}, "text_2", "context length"),
    # The engine refuses the first text too long, the first side's before the second's, whatever is longest.
    ("/score", {"text_1": [LONG, "b"], "text_2": ["c", LONG * 2]}, "text_1", "context length"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ""),
    ("/rerank", {"query": "", "documents": ["a"]}, "query", "must not be empty"),
    ("/rerank", {"query": "q", "documents": []}, "documents", "At least one text_pair element must be given"),
    ("/rerank", {"query": "q", "documents": [{"text": "a"}]}, "documents", "text only"),
    ("/rerank", {"query": "q", "documents": "a"}, "documents", ""),
    ("/rerank", {"query": LONG, "documents": ["a"]}, "query", "context length"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n", ""),
])
def test_bad_inputs_are_400s_naming_the_field(engine, path, body, param, message):
    async def scenario(client, http):
        return await http.post(path, json=body)

    response = serve(engine, scenario)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]
    assert error["param"] == param
    assert engine.stats.kv_pages_used == 0


def test_an_unknown_model_is_a_404(engine):
    async def scenario(client, http):
        return await http.post("/v1/score", json={"text_1": "a", "text_2": "b", "model": "nope"})

    assert serve(engine, scenario).status_code == 404
