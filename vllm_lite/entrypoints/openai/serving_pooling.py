"""/pooling, and what every pooling endpoint shares: the model check, `input` to token ids, one batch of
engine requests submitted together (so the core batches them), and vectors as floats or base64.

A pooling endpoint on a generate model is a 400 in vLLM's words ("The model does not support ... API");
base64 is the float32 vector's little-endian bytes, as OpenAI's client decodes it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from vllm_lite.entrypoints.openai.errors import BadRequestError, engine_request_error
from vllm_lite.entrypoints.openai.protocol import UsageInfo, random_id
from vllm_lite.entrypoints.openai.protocol_pooling import (
    EmbeddingInput,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
)
from vllm_lite.entrypoints.openai.serving_engine import OpenAIServing
from vllm_lite.entrypoints.openai.utils import shielded
from vllm_lite.outputs import PoolingRequestOutput
from vllm_lite.pooling_params import PoolingParams


def encode_vector(data: torch.Tensor, encoding_format: str) -> Union[list[float], list[list[float]], str]:
    """A pooled tensor as JSON floats, or base64 of its float32 little-endian bytes (OpenAI's encoding)."""
    if encoding_format == "base64":
        return base64.b64encode(data.to(torch.float32).numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return data.tolist()


def decode_base64_vector(text: str) -> np.ndarray:
    """The inverse of encode_vector's base64 (what OpenAI's client does with the string)."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


class OpenAIServingPoolingBase(OpenAIServing):
    """Helpers for the pooling endpoints; `api_name` words the wrong-runner error as vLLM does."""

    api_name = "Pooling"

    def check_pooling_model(self) -> None:
        if getattr(self.model_config, "runner_type", "generate") != "pooling":
            raise BadRequestError(f"The model does not support {self.api_name} API")

    def prompts_from_input(self, value: EmbeddingInput, add_special_tokens: bool) -> list[list[int]]:
        """OpenAI's `input`: a text, texts, one token-id list, or token-id lists -> token-id prompts."""
        if isinstance(value, str):
            value = [value]
        if not value:
            raise BadRequestError("input must not be empty.", param="input")
        if all(isinstance(x, int) for x in value):
            value = [value]  # type: ignore[list-item]
        prompts = []
        for item in value:
            ids = self.tokenize(item, add_special_tokens) if isinstance(item, str) else list(item)
            if not ids:
                raise BadRequestError("input has an empty prompt: it has no tokens.", param="input")
            prompts.append(ids)
        return prompts

    async def encode_all(
        self, prompts: Sequence[Any], params: Sequence[PoolingParams], priority: int = 0
    ) -> list[PoolingRequestOutput]:
        """Every prompt's finished output, the requests submitted together; any failure aborts the rest."""
        base = random_id("pool")
        request_ids = [f"{base}-{i}" for i in range(len(prompts))]

        async def one(prompt: Any, p: PoolingParams, request_id: str) -> PoolingRequestOutput:
            final: Optional[PoolingRequestOutput] = None
            async for out in self.engine.encode(prompt, p, request_id, priority=priority):
                final = out
            if final is None or final.error:
                raise engine_request_error(f"pooling request {request_id}: {final.error if final else 'no output'}")
            return final

        self.check_engine()
        try:
            return list(await asyncio.gather(*(one(x, p, r) for x, p, r in zip(prompts, params, request_ids))))
        except BaseException:
            for rid in request_ids:
                await shielded(self.engine.abort(rid))
            raise

    async def encode_token_prompts(
        self, prompts: list[list[int]], params: PoolingParams, priority: int = 0
    ) -> list[PoolingRequestOutput]:
        return await self.encode_all([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts), priority)

    async def pool_inputs(self, request: Any, task: str) -> list[PoolingRequestOutput]:
        """/v1/embeddings and /pooling alike: check the model, pool every input of ``request`` for ``task``."""
        self.check_model(request.model)
        self.check_pooling_model()
        params = PoolingParams(
            task=task,
            dimensions=request.dimensions,
            normalize=request.normalize,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        prompts = self.prompts_from_input(request.input, request.add_special_tokens)
        return await self.encode_token_prompts(prompts, params, request.priority)

    @staticmethod
    def usage(outputs: Sequence[PoolingRequestOutput]) -> UsageInfo:
        n = sum(len(o.prompt_token_ids) for o in outputs)
        return UsageInfo(prompt_tokens=n, total_tokens=n)


class OpenAIServingPooling(OpenAIServingPoolingBase):
    """POST /pooling: the pooled tensor of each input as the model's pooler returns it."""

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        outs = await self.pool_inputs(request, request.task or "encode")
        data = [
            PoolingResponseData(index=i, data=encode_vector(o.outputs.data, request.encoding_format))
            for i, o in enumerate(outs)
        ]
        return PoolingResponse(id=random_id("pool"), model=self.model_name, data=data, usage=self.usage(outs))
