"""Pydantic models of OpenAI's embeddings request and response (`POST /v1/embeddings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from sluice.app.schemas import Prompt, PromptTruncation, TextPromptEncoding, check_prompts

# OpenAI's limit, above a completion's: LangChain's OpenAIEmbeddings sends 1000 inputs a request.
MAX_INPUTS = 2048


def check_inputs(value: Prompt, info: ValidationInfo) -> Prompt:
    """`input`: as a completion's prompts (`check_prompts`), up to OpenAI's MAX_INPUTS of them."""
    return check_prompts(value, info, max_prompts=MAX_INPUTS)


class EmbeddingRequest(PromptTruncation, TextPromptEncoding):
    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="must be the model's hidden size (no truncation)")
    user: str | None = None

    _check_input = field_validator("input")(check_inputs)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="unit length; base64: little-endian float32 values")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
