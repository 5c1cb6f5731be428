"""/v1/completions: one engine request per prompt, n samples each, streamed or whole."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Optional, Union

from fastapi.responses import StreamingResponse

from vllm_lite.entrypoints.openai.errors import BadRequestError, as_serving_error
from vllm_lite.entrypoints.openai.field_support import COMPLETION_FIELDS
from vllm_lite.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from vllm_lite.entrypoints.openai.serving_engine import OpenAIServing
from vllm_lite.entrypoints.openai.structured_outputs import build_structured_outputs
from vllm_lite.entrypoints.openai.utils import (
    SSE_DONE,
    DisconnectWatcher,
    StreamChunkWriter,
    merge_async_iterators,
    shielded,
    sse,
)
from vllm_lite.outputs import RequestOutput


@dataclass
class _Prompt:
    text: Optional[str]  # None when given as token ids (decoded lazily for echo)
    token_ids: list[int]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request: Any = None
    ) -> Union[CompletionResponse, StreamingResponse]:
        lora_request = self.check_model_or_adapter(request.model)
        self.check_fields(COMPLETION_FIELDS, request)
        self.check_engine()
        if request.stream and request.best_of is not None and request.best_of > request.n:
            # As OpenAI: the best n of best_of are known only once all finish, so nothing can stream.
            raise BadRequestError(
                f"best_of ({request.best_of}) > n ({request.n}) cannot be streamed; set stream to false.",
                param="best_of",
            )
        if request.logprobs is not None and request.logprobs < 0:
            raise BadRequestError(f"logprobs must be non-negative, got {request.logprobs!r}.", param="logprobs")
        constraint = build_structured_outputs(request)
        constraint_field = constraint[0] if constraint is not None else None
        prompts = self._prompts(request)
        # echo + max_tokens=0 (lm-evaluation-harness's log-likelihood): score the prompt, generate nothing.
        # The engine runs one token, which the response leaves out, as vLLM does.
        echo_only = request.echo and request.max_tokens == 0
        params_list = []
        for p in prompts:
            max_tokens = self.resolve_max_tokens(len(p.token_ids), 1 if echo_only else request.max_tokens)
            params = request.build_sampling_params(
                max_tokens=max_tokens,
                logprobs=request.logprobs,
                prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None else None,
                defaults=self.default_sampling_params,
                stream=request.stream,
                best_of=request.best_of,
            )
            if constraint is not None:
                params.structured_outputs = constraint[1]
            self.validate_request(p.token_ids, params, constraint_field)
            params_list.append(params)

        model_name = self.response_model(lora_request)
        base_id = random_id("cmpl")
        created = int(time.time())
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        generators = [
            self.generate(
                {"prompt": p.text, "prompt_token_ids": p.token_ids}
                if p.text is not None
                else {"prompt_token_ids": p.token_ids},
                params,
                rid,
                request.priority,
                lora_request,
            )
            for p, params, rid in zip(prompts, params_list, request_ids)
        ]
        if constraint_field is not None:
            async with DisconnectWatcher(raw_request, lambda: self.abort_all(request_ids)):
                generators = await self.all_refused_before_tokens(generators, constraint_field)
        merged = merge_async_iterators(*generators)
        if request.stream:
            body = self._stream(
                request, prompts, merged, base_id, created, request_ids, raw_request, echo_only, model_name
            )
            return StreamingResponse(body, media_type="text/event-stream")

        finals: list[Optional[RequestOutput]] = [None] * len(prompts)
        async with DisconnectWatcher(raw_request, lambda: self.abort_all(request_ids)):
            try:
                async for i, out in merged:
                    finals[i] = out
            finally:
                await shielded(merged.aclose())
        return self._response(request, prompts, finals, base_id, created, echo_only, model_name)

    # ------------------------------------------------------------------ prompts
    def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt:
            items = list(prompt)
        else:
            raise BadRequestError("prompt must not be empty.", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                if item == "":
                    raise BadRequestError("prompt must not be an empty string.", param="prompt")
                ids = self.tokenize(item, request.add_special_tokens)
                kept = self.truncate(ids, request.truncate_prompt_tokens)
                out.append(_Prompt(item if kept is ids else None, kept))
            else:
                if not item:
                    raise BadRequestError("prompt token id lists must not be empty.", param="prompt")
                out.append(_Prompt(None, self.truncate(list(item), request.truncate_prompt_tokens)))
        return out

    def _prompt_text(self, p: _Prompt) -> str:
        if p.text is None:
            p.text = self.tokenizer.decode(p.token_ids, skip_special_tokens=False)
        return p.text

    # ------------------------------------------------------------------ whole response
    def _response(
        self,
        request: CompletionRequest,
        prompts: list[_Prompt],
        finals: list[Optional[RequestOutput]],
        base_id: str,
        created: int,
        echo_only: bool = False,
        model_name: Optional[str] = None,
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        usage = UsageInfo()
        for i, (p, out) in enumerate(zip(prompts, finals)):
            usage.prompt_tokens += len(p.token_ids)
            if out is None:  # aborted before any output (client left)
                continue
            if out.error:
                raise as_serving_error(RuntimeError(out.error))
            for c in sorted(out.outputs, key=lambda c: c.index):
                text, logprobs = ("", None) if echo_only else (c.text, None)
                gen_ids, gen_lps = ([], []) if echo_only else (list(c.token_ids), list(c.logprobs or []))
                if request.echo:
                    text = self._prompt_text(p) + text
                if request.logprobs is not None:
                    ids, lps = gen_ids, gen_lps
                    if request.echo:
                        ids = p.token_ids + ids
                        lps = self._prompt_lps(out, len(p.token_ids)) + lps
                    logprobs = self.completion_logprobs(ids, lps, request.logprobs)
                usage.completion_tokens += len(gen_ids)
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason="length" if echo_only else c.finish_reason,
                        stop_reason=None if echo_only else c.stop_reason,
                        token_ids=gen_ids if request.return_token_ids else None,
                        prompt_token_ids=p.token_ids if request.return_token_ids else None,
                    )
                )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        model = model_name or self.model_name
        return CompletionResponse(id=base_id, created=created, model=model, choices=choices, usage=usage)

    @staticmethod
    def _prompt_lps(out: RequestOutput, n: int) -> list:
        lps = list(out.prompt_logprobs or [])
        return (lps + [None] * n)[:n]

    # ------------------------------------------------------------------ streaming
    async def _stream(
        self,
        request: CompletionRequest,
        prompts: list[_Prompt],
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
        base_id: str,
        created: int,
        request_ids: list[str],
        raw_request: Any,
        echo_only: bool = False,
        model_name: Optional[str] = None,
    ) -> AsyncGenerator[str, None]:
        model = model_name or self.model_name
        n = request.n
        num_choices = len(prompts) * n
        text_offsets = [0] * num_choices
        echoed = [False] * num_choices
        completion_tokens = [0] * num_choices
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        prompt_lps_by_prompt: dict[int, list] = {}
        # Text-only chunks (the usual stream) are written from prebuilt JSON, not a pydantic model each.
        writer = None
        if request.logprobs is None and not request.return_token_ids and not request.continuous_usage:
            writer = StreamChunkWriter(False, base_id, created, model)
        try:
            async with DisconnectWatcher(raw_request, lambda: self.abort_all(request_ids)):
                async for i, out in merged:
                    p = prompts[i]
                    if out.prompt_logprobs:
                        prompt_lps_by_prompt.setdefault(i, []).extend(out.prompt_logprobs)
                    for c in out.outputs:
                        if out.error and not c.token_ids:
                            continue  # a failed choice with nothing new: only the error event follows
                        idx = i * n + c.index
                        text = "" if echo_only else c.text
                        ids, lps = ([], []) if echo_only else (list(c.token_ids), list(c.logprobs or []))
                        gen_ids = ids
                        if request.echo and not echoed[idx]:
                            echoed[idx] = True
                            text = self._prompt_text(p) + text
                            ids = p.token_ids + ids
                            plps = prompt_lps_by_prompt.get(i, [])
                            lps = (plps + [None] * len(p.token_ids))[: len(p.token_ids)] + lps
                        logprobs = None
                        if request.logprobs is not None:
                            logprobs = self.completion_logprobs(ids, lps, request.logprobs, text_offsets[idx])
                        text_offsets[idx] += len(text)
                        completion_tokens[idx] += len(gen_ids)
                        if writer is not None:
                            yield writer.event(
                                idx,
                                text,
                                _stream_finish_reason(out, c, echo_only),
                                None if echo_only or out.error else c.stop_reason,
                            )
                            continue
                        chunk = CompletionStreamResponse(
                            id=base_id,
                            created=created,
                            model=model,
                            choices=[
                                CompletionResponseStreamChoice(
                                    index=idx,
                                    text=text,
                                    logprobs=logprobs,
                                    finish_reason=_stream_finish_reason(out, c, echo_only),
                                    stop_reason=None if echo_only or out.error else c.stop_reason,
                                    token_ids=gen_ids if request.return_token_ids else None,
                                )
                            ],
                        )
                        if request.continuous_usage:
                            chunk.usage = _usage(prompt_tokens, sum(completion_tokens))
                        yield sse(chunk)
                    if out.error:  # after the tokens that arrived with it (merged behind unread deltas)
                        raise RuntimeError(out.error)
            if request.include_usage:
                final = CompletionStreamResponse(
                    id=base_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=_usage(prompt_tokens, sum(completion_tokens)),
                )
                yield sse(final)
        except Exception as e:  # headers are gone: the error travels as an event
            yield sse(as_serving_error(e).to_response())
        finally:
            await shielded(merged.aclose())
        yield SSE_DONE


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _stream_finish_reason(out: RequestOutput, c: Any, echo_only: bool) -> Optional[str]:
    """A failed request ends with its error event, never with a finish_reason of its own."""
    if out.error:
        return None
    return "length" if echo_only and c.finish_reason else c.finish_reason
