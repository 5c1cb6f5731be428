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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    random_id,
)
from vllm_lite.entrypoints.openai.serving_engine import OpenAIServing
from vllm_lite.entrypoints.openai.structured_outputs import build_structured_outputs
from vllm_lite.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from vllm_lite.entrypoints.openai.tool_parsers import StreamDelta, ToolCallStreamer, ToolParser, ToolParserManager
from vllm_lite.entrypoints.openai.utils import SSE_DONE, DisconnectWatcher, StreamChunkWriter, shielded, sse
from vllm_lite.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """Chat completions; `response_role` is the role of the replies (vLLM's --response-role).

    `enable_auto_tool_choice` and `tool_call_parser` are vLLM's --enable-auto-tool-choice and
    --tool-call-parser: tool_choice "auto" reads tool calls out of replies with that parser.
    """

    def __init__(
        self,
        *args: Any,
        response_role: str = "assistant",
        enable_auto_tool_choice: bool = False,
        tool_call_parser: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role
        self.tool_parser: Optional[ToolParser] = None
        if enable_auto_tool_choice:
            if not tool_call_parser:
                raise ValueError("--enable-auto-tool-choice needs --tool-call-parser to say how to read tool calls.")
            try:
                self.tool_parser = ToolParserManager.get_tool_parser(tool_call_parser)(self.tokenizer)
            except KeyError as e:
                raise ValueError(f"--tool-call-parser: {e.args[0]}") from None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Any = None
    ) -> Union[ChatCompletionResponse, StreamingResponse]:
        lora_request = self.check_model_or_adapter(request.model)
        self.check_fields(CHAT_FIELDS, request)
        self.check_engine()
        top_logprobs = request.top_logprobs
        if top_logprobs is not None and top_logprobs < 0:
            raise BadRequestError(f"top_logprobs must be non-negative, got {top_logprobs!r}.", param="top_logprobs")
        if top_logprobs and not request.logprobs:
            raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        num_logprobs = (top_logprobs or 0) if request.logprobs else None
        plan = plan_tools(request, self.tool_parser)
        constraint = build_structured_outputs(request, plan.constraint)
        prompt_text = self.render_chat(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            request.chat_template,
            tools=plan.tools,
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
        constraint_field = None
        if constraint is not None:
            constraint_field, params.structured_outputs = constraint
        self.validate_request(prompt_ids, params, constraint_field)

        request_id = random_id("chatcmpl")
        created = int(time.time())
        gen = self.generate(
            {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
            if prompt_ids is full_ids
            else {"prompt_token_ids": prompt_ids},
            params,
            request_id,
            request.priority,
            lora_request,
        )
        if constraint_field is not None:
            async with DisconnectWatcher(raw_request, lambda: self.abort_all([request_id])):
                gen = await self.refused_before_tokens(gen, constraint_field)
        if request.stream:
            body = self._stream(
                request, prompt_ids, gen, request_id, created, raw_request, plan, self.response_model(lora_request)
            )
            return StreamingResponse(body, media_type="text/event-stream")

        final: Optional[RequestOutput] = None
        async with DisconnectWatcher(raw_request, lambda: self.abort_all([request_id])):
            try:
                async for out in gen:
                    final = out
            finally:
                await shielded(gen.aclose())
        return self._response(
            request, prompt_ids, final, request_id, created, num_logprobs, plan, self.response_model(lora_request)
        )

    # ------------------------------------------------------------------ whole response
    def _response(
        self,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
        final: Optional[RequestOutput],
        request_id: str,
        created: int,
        num_logprobs: Optional[int],
        plan: ToolPlan,
        model_name: Optional[str] = None,
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
            message, finish_reason = self._message(c.text, c.finish_reason, plan)
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model_name or self.model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=len(prompt_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(prompt_ids) + completion_tokens,
            ),
            prompt_token_ids=prompt_ids if request.return_token_ids else None,
        )

    def _message(self, text: str, finish_reason: Optional[str], plan: ToolPlan) -> tuple[ChatMessage, Optional[str]]:
        """The reply, with its tool calls when the plan reads them; finish_reason "tool_calls" when it made some."""
        if plan.parser is None:
            return ChatMessage(role=self.response_role, content=text), finish_reason
        info = plan.parser.extract_tool_calls(text)
        if not info.tools_called:
            return ChatMessage(role=self.response_role, content=info.content), finish_reason
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in info.tool_calls]
        message = ChatMessage(role=self.response_role, content=info.content, tool_calls=calls)
        return message, _tool_finish_reason(finish_reason)

    # ------------------------------------------------------------------ streaming
    async def _stream(
        self,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
        gen: AsyncGenerator[RequestOutput, None],
        request_id: str,
        created: int,
        raw_request: Any,
        plan: ToolPlan,
        model_name: Optional[str] = None,
    ) -> AsyncGenerator[str, None]:
        model = model_name or self.model_name
        n = request.n
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        completion_tokens = [0] * n
        parser = plan.parser
        streamers = [ToolCallStreamer(parser) for _ in range(n)] if parser is not None else None

        # Text-only chunks (the usual stream) are written from prebuilt JSON, not pydantic models each.
        writer = None
        if streamers is None and num_logprobs is None and not request.return_token_ids and not request.continuous_usage:
            writer = StreamChunkWriter(True, request_id, created, model)

        def chunk(choices: list[ChatCompletionResponseStreamChoice]) -> ChatCompletionStreamResponse:
            c = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices)
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
                    for c in out.outputs:
                        if out.error and not c.token_ids:
                            continue  # a failed choice with nothing new: only the error event follows
                        # A failed request ends with its error event, never with a finish_reason of its own.
                        ended = None if out.error else c.finish_reason
                        completion_tokens[c.index] += len(c.token_ids)
                        if writer is not None:
                            yield writer.event(c.index, c.text, ended, None if out.error else c.stop_reason)
                            continue
                        logprobs = None
                        if num_logprobs is not None:
                            logprobs = self.chat_logprobs(c.token_ids, c.logprobs or [], num_logprobs)
                        delta, finish_reason = DeltaMessage(content=c.text), ended
                        if streamers is not None:
                            streamer = streamers[c.index]
                            parsed = streamer.feed(c.text)
                            if ended is not None:
                                parsed = _merge(parsed, streamer.finish())
                            if not parsed and ended is None and logprobs is None:
                                if not request.return_token_ids:
                                    continue  # held back (a possible tool-call marker): nothing to send yet
                            delta = _delta_message(parsed)
                            if streamer.tools_called:
                                finish_reason = _tool_finish_reason(ended)
                        yield sse(
                            chunk(
                                [
                                    ChatCompletionResponseStreamChoice(
                                        index=c.index,
                                        delta=delta,
                                        logprobs=logprobs,
                                        finish_reason=finish_reason,
                                        stop_reason=None if out.error else c.stop_reason,
                                        token_ids=list(c.token_ids) if request.return_token_ids else None,
                                    )
                                ]
                            )
                        )
                    if out.error:  # after the tokens that arrived with it (merged behind unread deltas)
                        raise RuntimeError(out.error)
            if request.include_usage:
                final = ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
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


def _tool_finish_reason(finish_reason: Optional[str]) -> Optional[str]:
    """A reply that ended normally with tool calls finishes with "tool_calls"; length and abort stay."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _merge(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    return StreamDelta(a.content + b.content, a.tool_calls + b.tool_calls)


def _delta_message(parsed: StreamDelta) -> DeltaMessage:
    """OpenAI's streamed shapes: a call's first delta has index, id, type and name; later ones its argument text."""
    calls = []
    for d in parsed.tool_calls:
        if d.name is not None:
            function = DeltaFunctionCall(name=d.name, arguments=d.arguments)
            calls.append(DeltaToolCall(index=d.index, id=d.id, type="function", function=function))
        else:
            calls.append(DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments)))
    return DeltaMessage(content=parsed.content or None, tool_calls=calls)
