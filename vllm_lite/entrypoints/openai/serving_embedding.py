"""POST /v1/embeddings: OpenAI's embeddings API over a pooling model (one vector per input, in input order)."""

from __future__ import annotations

from vllm_lite.entrypoints.openai.protocol import random_id
from vllm_lite.entrypoints.openai.protocol_pooling import EmbeddingRequest, EmbeddingResponse, EmbeddingResponseData
from vllm_lite.entrypoints.openai.serving_pooling import OpenAIServingPoolingBase, encode_vector
from vllm_lite.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServingPoolingBase):
    api_name = "Embeddings"

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(request.model)
        self.check_pooling_model()
        params = PoolingParams(
            task="embed",
            dimensions=request.dimensions,
            normalize=request.normalize,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        prompts = self.prompts_from_input(request.input, request.add_special_tokens)
        outs = await self.encode_token_prompts(prompts, params, request.priority)
        data = [
            EmbeddingResponseData(index=i, embedding=encode_vector(o.outputs.data, request.encoding_format))
            for i, o in enumerate(outs)
        ]
        return EmbeddingResponse(id=random_id("embd"), model=self.model_name, data=data, usage=self.usage(outs))
