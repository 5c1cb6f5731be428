"""POST /score and /rerank (vLLM's): relevance of text pairs, from the same pooling engine.

An embedding model scores a pair by the cosine of the two texts' embeddings; a cross-encoder
(`*ForSequenceClassification` with one label) reads both texts as one prompt (the tokenizer's pair encoding)
and its classifier's output is the score, through its sigmoid, as vLLM's score task does. /rerank scores the
query against every document and returns them by relevance, best first, the top `top_n` (0: all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_lite.client.processor import check_prompt_text
from vllm_lite.client.token_types import encode_pair
from vllm_lite.entrypoints.openai.errors import BadRequestError
from vllm_lite.entrypoints.openai.protocol import random_id
from vllm_lite.entrypoints.openai.protocol_pooling import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from vllm_lite.entrypoints.openai.serving_pooling import OpenAIServingPoolingBase
from vllm_lite.pooling_config import is_classifier_architecture
from vllm_lite.pooling_params import PoolingParams


class OpenAIServingScores(OpenAIServingPoolingBase):
    api_name = "Score"

    def _is_cross_encoder(self) -> bool:
        if not is_classifier_architecture([self.model_config.architecture]):
            return False
        hf = self.model_config.hf_config
        num_labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2))
        if num_labels != 1:
            raise BadRequestError(
                f"The model does not support {self.api_name} API: a classifier with {num_labels} labels is not a "
                "cross-encoder (one label)."
            )
        return True

    async def scores(
        self, text_1: list[str], text_2: list[str], truncate_prompt_tokens: int | None, priority: int
    ) -> tuple[list[float], int]:
        """One score per pair text_1[i], text_2[i], and the prompt tokens spent."""
        self.check_pooling_model()
        if self._is_cross_encoder():
            prompts = []
            for a, b in zip(text_1, text_2):
                for text in (a, b):  # the size and text checks every prompt gets, before the pair is encoded
                    check_prompt_text(text, self.max_model_len, self.tokenizer)
                prompts.append(encode_pair(self.tokenizer, a, b))  # with the pair's token types
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
            outs = await self.encode_all(prompts, [params] * len(prompts), priority)
            return [float(o.outputs.data.reshape(-1)[0]) for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        texts = list(dict.fromkeys(text_1 + text_2))  # each distinct text embedded once
        params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        outs = await self.encode_token_prompts([self.tokenize(t, True) for t in texts], params, priority)
        vec = {t: o.outputs.data for t, o in zip(texts, outs)}
        a = torch.stack([vec[t] for t in text_1])
        b = torch.stack([vec[t] for t in text_2])
        used = sum(len(outs[texts.index(t)].prompt_token_ids) for t in text_1 + text_2)
        return F.cosine_similarity(a, b, dim=-1).tolist(), used

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        self.check_model(request.model)
        t1 = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        t2 = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        if not t1 or not t2:
            raise BadRequestError("text_1 and text_2 must each hold at least one text.", param="text_1")
        if len(t1) == 1:
            t1 = t1 * len(t2)
        if len(t1) != len(t2):
            raise BadRequestError(
                f"text_1 has {len(t1)} texts and text_2 {len(t2)}: pass one text_1, or as many as text_2.",
                param="text_2",
            )
        scores, used = await self.scores(t1, t2, request.truncate_prompt_tokens, request.priority)
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        usage = self.usage([])
        usage.prompt_tokens = usage.total_tokens = used
        return ScoreResponse(id=random_id("score"), model=self.model_name, data=data, usage=usage)


class OpenAIServingRerank(OpenAIServingScores):
    api_name = "Rerank (Score)"

    async def do_rerank(self, request: RerankRequest) -> RerankResponse:
        self.check_model(request.model)
        if not request.documents:
            raise BadRequestError("documents must hold at least one document.", param="documents")
        if request.top_n < 0:
            raise BadRequestError(f"top_n must be >= 0 (0: all), got {request.top_n}.", param="top_n")
        docs = list(request.documents)
        scores, used = await self.scores(
            [request.query] * len(docs), docs, request.truncate_prompt_tokens, request.priority
        )
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(index=i, document=RerankDocument(text=docs[i]), relevance_score=scores[i]) for i in order
        ]
        return RerankResponse(
            id=random_id("rerank"), model=self.model_name, usage=RerankUsage(total_tokens=used), results=results
        )
