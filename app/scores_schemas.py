"""Pydantic models of vLLM's score (`POST /score`, `/v1/score`) and rerank (`POST /rerank`, `/v1/rerank`,
`/v2/rerank`, Jina's and Cohere's API) requests and responses, as vLLM serves them for an embedding model.

Texts only: vLLM's multimodal inputs (`{"content": [...]}`) are refused by name, as vLLM refuses them for an
embedding model. Every text must be non-empty (an empty one has no token to pool).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from sluice.app.embeddings_schemas import MAX_INPUTS, EmbeddingUsage
from sluice.app.schemas import PromptTruncation, TextPromptEncoding, check_prompts, field_error

Texts = str | list[str]


def text_only(value: Any) -> Any:
    """A before-validator: a multimodal input (an object, or a list holding one) is refused by what it is, not by
    the union's failed branches."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, dict) for item in items):
        raise ValueError("multimodal inputs are not supported: the model reads text only; give strings")
    return value


# vLLM's messages for a side of the pairs with no text.
NO_TEXT_1 = "At least one text element must be given"
NO_TEXT_2 = "At least one text_pair element must be given"


def texts_check(at_least_one: str):
    """A validator of a field of texts: at least one (`at_least_one`: vLLM's message when there is none), none
    empty, at most embeddings' MAX_INPUTS."""

    def check(value: Texts, info: ValidationInfo) -> Texts:
        if value == []:
            raise ValueError(at_least_one)
        return check_prompts(value, info, max_prompts=MAX_INPUTS)

    return check


def as_list(texts: Texts) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


class _ScoringRequest(PromptTruncation, TextPromptEncoding):
    model: str | None = None


class ScoreRequest(_ScoringRequest):
    text_1: Texts = Field(description="one text, or N: each scored against text_2's")
    text_2: Texts = Field(description="with one text_1, any number; with N, exactly N (paired in order)")

    _text_only = field_validator("text_1", "text_2", mode="before")(text_only)

    _check_text_1 = field_validator("text_1")(texts_check(NO_TEXT_1))
    _check_text_2 = field_validator("text_2")(texts_check(NO_TEXT_2))

    @model_validator(mode="after")
    def _pairs(self) -> ScoreRequest:
        num_1, num_2 = len(as_list(self.text_1)), len(as_list(self.text_2))
        if num_1 > 1 and num_1 != num_2:
            raise field_error("text_2", "Input lengths must be either 1:1, 1:N or N:N", self.text_2)
        return self


class RerankRequest(_ScoringRequest):
    query: str
    documents: list[str]
    top_n: int = Field(0, description="how many of the best documents to return; 0 or less: all (vLLM's)")
    return_documents: bool = Field(True, description="Cohere's and Jina's: false leaves each result's document "
                                   "out (vLLM always returns it)")

    _text_only = field_validator("query", "documents", mode="before")(text_only)

    _check_query = field_validator("query")(texts_check(NO_TEXT_1))
    _check_documents = field_validator("documents")(texts_check(NO_TEXT_2))


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float = Field(description="the cosine similarity of the pair's embeddings")


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="the document's index in the request")
    document: RerankDocument | None = Field(None, description="absent (null) with return_documents false")
    relevance_score: float = Field(description="the cosine similarity of the query's and the document's embeddings")


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: EmbeddingUsage
    results: list[RerankResult] = Field(description="by relevance_score, highest first; top_n of them")
