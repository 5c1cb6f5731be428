"""POST /v1/embeddings: OpenAI's embeddings API over a pooling model (one vector per input, in input order)."""

from __future__ import annotations

from vllm_lite.entrypoints.openai.protocol import random_id
from vllm_lite.entrypoints.openai.protocol_pooling import EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData
from vllm_lite.entrypoints.openai.serving_pooling import OpenAIServingPoolingBase, encode_vector


class OpenAIServingEmbedding(OpenAIServingPoolingBase):
    api_name = "Embeddings"

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        outs = await self.pool_inputs(request, "embed")
        data = [
            EmbeddingResponseData(index=i, embedding=encode_vector(o.outputs.data, request.encoding_format))
            for i, o in enumerate(outs)
        ]
        return EmbeddingResponse(id=random_id("embd"), model=self.model_name, data=data, usage=self.usage(outs))
