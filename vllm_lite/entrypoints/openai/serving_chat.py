"""/v1/chat/completions: render the conversation with the chat template, then one engine request (n samples)."""

from __future__ import annotations

import time
from typing import Any, AsyncGenerator, Optional, Union

from fastapi.responses import StreamingResponse

from vllm_lite.entrypoints.openai.errors import BadRequestError, as_serving_error
from vllm_lite.entrypoints.openai.field_support import CHAT_FIELDS
from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from vllm_lite.entrypoints.openai.serving_engine import OpenAIServing
from vllm_lite.entrypoints.openai.utils import SSE_DONE, DisconnectWatcher, shielded, sse
from vllm_lite.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """Chat completions; `response_role` is the role of the replies (vLLM's --response-role)."""

    def __init__(self, *args: Any, response_role: str = "assistant", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Any = None
    ) -> Union[ChatCompletionResponse, StreamingResponse]:
        self.check_model(request.model)
        self.check_fields(CHAT_FIELDS, request)
        self.check_engine()
        top_logprobs = request.top_logprobs
        if top_logprobs is not None and top_logprobs < 0:
            raise BadRequestError(f"top_logprobs must be non-negative, got {top_logprobs!r}.", param="top_logprobs")
        if top_logprobs and not request.logprobs:
            raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        num_logprobs = (top_logprobs or 0) if request.logprobs else None
        prompt_text = self.render_chat(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.chat_template,
        )
        full_ids = self.tokenize(prompt_text, request.add_special_tokens)
        prompt_ids = self.truncate(full_ids, request.truncate_prompt_tokens)
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = self.resolve_max_tokens(len(prompt_ids), requested)
        params = request.build_sampling_params(
            max_tokens=max_tokens,
            logprobs=num_logprobs,
            prompt_logprobs=None,
            defaults=self.default_sampling_params,
            stream=request.stream,
        )
        self.validate_request(prompt_ids, params)

        request_id = random_id("chatcmpl")
        created = int(time.time())
        gen = self.generate(
            {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
            if prompt_ids is full_ids
            else {"prompt_token_ids": prompt_ids},
            params,
            request_id,
            request.priority,
        )
        if request.stream:
            body = self._stream(request, prompt_ids, gen, request_id, created, raw_request)
            return StreamingResponse(body, media_type="text/event-stream")

        final: Optional[RequestOutput] = None
        async with DisconnectWatcher(raw_request, lambda: self.abort_all([request_id])):
            try:
                async for out in gen:
                    final = out
            finally:
                await shielded(gen.aclose())
        return self._response(request, prompt_ids, final, request_id, created, num_logprobs)

    # ------------------------------------------------------------------ whole response
    def _response(
        self,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
        final: Optional[RequestOutput],
        request_id: str,
        created: int,
        num_logprobs: Optional[int],
    ) -> ChatCompletionResponse:
        choices = []
        completion_tokens = 0
        if final is not None and final.error:
            raise as_serving_error(RuntimeError(final.error))
        for c in sorted(final.outputs if final is not None else [], key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            logprobs = None
            if num_logprobs is not None:
                logprobs = self.chat_logprobs(c.token_ids, c.logprobs or [], num_logprobs)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatMessage(role=self.response_role, content=c.text),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=len(prompt_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt_ids) + completion_tokens,
            ),
            prompt_token_ids=prompt_ids if request.return_token_ids else None,
        )

    # ------------------------------------------------------------------ streaming
    async def _stream(
        self,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
        gen: AsyncGenerator[RequestOutput, None],
        request_id: str,
        created: int,
        raw_request: Any,
    ) -> AsyncGenerator[str, None]:
        n = request.n
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        completion_tokens = [0] * n

        def chunk(choices: list[ChatCompletionResponseStreamChoice]) -> ChatCompletionStreamResponse:
            c = ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=choices)
            if request.continuous_usage:
                c.usage = _usage(len(prompt_ids), sum(completion_tokens))
            return c

        try:
            # OpenAI's first chunk per choice carries only the role.
            for i in range(n):
                first = chunk(
                    [
                        ChatCompletionResponseStreamChoice(
                            index=i, delta=DeltaMessage(role=self.response_role, content="")
                        )
                    ]
                )
                if request.return_token_ids and i == 0:
                    first.prompt_token_ids = prompt_ids
                yield sse(first)
            async with DisconnectWatcher(raw_request, lambda: self.abort_all([request_id])):
                async for out in gen:
                    if out.error:
                        raise RuntimeError(out.error)
                    for c in out.outputs:
                        completion_tokens[c.index] += len(c.token_ids)
                        logprobs = None
                        if num_logprobs is not None:
                            logprobs = self.chat_logprobs(c.token_ids, c.logprobs or [], num_logprobs)
                        yield sse(
                            chunk(
                                [
                                    ChatCompletionResponseStreamChoice(
                                        index=c.index,
                                        delta=DeltaMessage(content=c.text),
                                        logprobs=logprobs,
                                        finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason,
                                        token_ids=list(c.token_ids) if request.return_token_ids else None,
                                    )
                                ]
                            )
                        )
            if request.include_usage:
                final = ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=_usage(len(prompt_ids), sum(completion_tokens)),
                )
                yield sse(final)
        except Exception as e:  # headers are gone: the error travels as an event
            yield sse(as_serving_error(e).to_response())
        finally:
            await shielded(gen.aclose())
        yield SSE_DONE


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
