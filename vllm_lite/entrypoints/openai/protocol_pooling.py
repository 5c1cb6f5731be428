"""Request and response bodies of the pooling endpoints: OpenAI's /v1/embeddings, vLLM's /pooling, /score, /rerank.

Field names and shapes are OpenAI's (embeddings) and vLLM's (the rest, and the extras on embeddings:
`truncate_prompt_tokens`, `add_special_tokens`, `normalize`, `priority`), so their clients work unchanged.
Requests are typed strictly, as the completion requests are: unknown fields and wrong JSON types are a 400.
"""

from __future__ import annotations

import time
from typing import Generic, Literal, Optional, TypeVar, Union

from pydantic import Field

from vllm_lite.entrypoints.openai.protocol import OpenAIBaseModel, StrictRequestModel, UsageInfo

# One text, several texts, one token-id prompt, or several: OpenAI's `input`.
EmbeddingInput = Union[str, list[str], list[int], list[list[int]]]


class _PoolingInputFields(StrictRequestModel):
    model: Optional[str] = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM's extras
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    normalize: Optional[bool] = None
    priority: int = 0


class EmbeddingRequest(_PoolingInputFields):
    """POST /v1/embeddings (OpenAI's)."""


class PoolingRequest(_PoolingInputFields):
    """POST /pooling (vLLM's): the model's raw pooled output per input, by `task` (default "encode")."""

    task: Optional[Literal["encode", "embed", "classify", "token_embed", "token_classify"]] = None


class ScoreRequest(StrictRequestModel):
    """POST /score (vLLM's): text_1[i] against text_2[i], or one text_1 against every text_2."""

    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate_prompt_tokens: Optional[int] = None
    priority: int = 0


class RerankRequest(StrictRequestModel):
    """POST /rerank (vLLM's, Jina/Cohere shaped): the documents ordered by relevance to the query."""

    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: int = 0  # 0: all of them
    truncate_prompt_tokens: Optional[int] = None
    priority: int = 0


_ResponseData = TypeVar("_ResponseData")


class _ListResponse(OpenAIBaseModel, Generic[_ResponseData]):
    """The list body /v1/embeddings, /pooling and /score answer with (fields in this order), by its data's type."""

    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[_ResponseData]
    usage: UsageInfo


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(_ListResponse[EmbeddingResponseData]):
    pass


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: Union[list[float], list[list[float]], str]


class PoolingResponse(_ListResponse[PoolingResponseData]):
    pass


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_ListResponse[ScoreResponseData]):
    pass


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
