"""/tokenize and /detokenize: the server's tokenizer and chat template, without generating."""

from __future__ import annotations

from vllm_lite.entrypoints.openai.errors import BadRequestError
from vllm_lite.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm_lite.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize_request(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model_or_adapter(request.model)  # an adapter shares the base model's tokenizer
        if (request.prompt is None) == (request.messages is None):
            raise BadRequestError("Pass exactly one of prompt and messages.", param="prompt")
        if request.messages is not None:
            text = self.render_chat(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
            )
            add_special = bool(request.add_special_tokens) if request.add_special_tokens is not None else False
        else:
            text = request.prompt or ""
            add_special = request.add_special_tokens if request.add_special_tokens is not None else True
        ids = self.tokenize(text, add_special)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize_request(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model_or_adapter(request.model)  # an adapter shares the base model's tokenizer
        vocab = int(getattr(self.model_config, "vocab_size", 0) or len(self.tokenizer))
        bad = [t for t in request.tokens if t < 0 or t >= vocab]
        if bad:
            raise BadRequestError(f"tokens contains ids out of vocabulary (size {vocab}): {bad[:8]!r}.", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
