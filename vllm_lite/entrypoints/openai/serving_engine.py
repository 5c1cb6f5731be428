"""What every OpenAI endpoint shares: model-name checks, tokenization and
length limits, running engine requests with clean aborts, and logprob formatting.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncGenerator, Optional, Sequence

from vllm_lite.client.processor import check_prompt_text
from vllm_lite.entrypoints.chat_utils import with_tool_call_arguments_parsed
from vllm_lite.entrypoints.openai.errors import BadRequestError, EngineUnavailableError, ModelNotFoundError
from vllm_lite.entrypoints.openai.field_support import refused_field
from vllm_lite.entrypoints.openai.health import engine_is_dead
from vllm_lite.entrypoints.openai.metrics import ServerMetrics
from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)
from vllm_lite.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_lite.entrypoints.openai.utils import shielded
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import Logprob, RequestOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.structured_output.validation import validate_structured_outputs

logger = logging.getLogger(__name__)

# JSON has no -inf: OpenAI's clients expect a finite floor.
MIN_LOGPROB = -9999.0


class OpenAIServing:
    """Base of the completion, chat and tokenization handlers."""

    def __init__(
        self,
        engine: Any,
        served_model_names: Sequence[str],
        metrics: Optional[ServerMetrics] = None,
        *,
        chat_template: Optional[str] = None,
        models: Optional[OpenAIServingModels] = None,
    ) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model.")
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        # The LoRA adapters a request's `model` may name (shared by every endpoint; None: the base model only).
        self.models = models
        self.model_config = engine.model_config
        self.max_model_len = int(self.model_config.max_model_len)
        # The attribute, not get_tokenizer(): AsyncLLM's is a coroutine, as in vLLM.
        self.tokenizer = engine.tokenizer
        self.metrics = metrics
        # --chat-template (text or a file), resolved once: the default for requests that send none.
        self.chat_template = _load_chat_template(chat_template) if chat_template is not None else None
        self.processor = getattr(engine, "processor", None)
        self.default_sampling_params: Optional[SamplingParams] = None
        if self.processor is not None and hasattr(self.processor, "get_default_sampling_params"):
            self.default_sampling_params = self.processor.get_default_sampling_params()

    # ------------------------------------------------------------------ checks
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.served_model_names:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")

    def check_model_or_adapter(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter `model` names (None: the base model); 404 for a name that is neither."""
        if self.models is None or model is None or model in self.served_model_names:
            self.check_model(model)
            return None
        return self.models.lora_request(model)

    def response_model(self, lora_request: Optional[LoRARequest]) -> str:
        """The `model` a response reports: the adapter's name when one ran (vLLM's rule)."""
        return lora_request.lora_name if lora_request is not None else self.model_name

    @staticmethod
    def check_fields(rules: dict, request: Any) -> None:
        """400 naming the first field this request uses that the server refuses (field_support.py)."""
        refused = refused_field(rules, request)
        if refused is not None:
            name, reason = refused
            raise BadRequestError(f"{name} is not supported by this server: {reason}.", param=name)

    @staticmethod
    def truncate(prompt_ids: list[int], truncate_prompt_tokens: Optional[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens."""
        if truncate_prompt_tokens is None or len(prompt_ids) <= truncate_prompt_tokens:
            return prompt_ids
        return prompt_ids[-truncate_prompt_tokens:]

    def check_engine(self) -> None:
        if engine_is_dead(self.engine):
            raise EngineUnavailableError("The engine is not available: the engine core died.")

    def resolve_max_tokens(self, prompt_len: int, max_tokens: Optional[int]) -> Optional[int]:
        """Check the prompt (and prompt + max_tokens) against max_model_len; None -> all that is left."""
        if prompt_len == 0:
            raise BadRequestError("The prompt is empty: it has no tokens.", param="prompt")
        if prompt_len >= self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room to generate. Please reduce the length of the prompt.",
                param="prompt",
            )
        if max_tokens is None:
            return self.max_model_len - prompt_len
        if isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
                f"Please reduce the length of the prompt or the completion.",
                param="max_tokens",
            )
        return max_tokens  # < 1: SamplingParams names the problem

    def validate_request(
        self, prompt_ids: list[int], params: SamplingParams, constraint_field: Optional[str] = None
    ) -> None:
        """Run the engine's own input checks now, so a bad request is a 400 before any stream starts.

        `constraint_field`: the request field the structured-output constraint came from; a constraint
        the grammar compiler refuses is a 400 naming it, with the compiler's message.
        """
        if constraint_field is not None and params.structured_outputs is not None:
            try:  # the processor checks it too (cached): here the error can name the request's field
                validate_structured_outputs(params.structured_outputs)
            except (ValueError, TypeError) as e:
                raise BadRequestError(str(e), param=constraint_field) from e
        if self.processor is not None and hasattr(self.processor, "process_inputs"):
            self.processor.process_inputs("validate", {"prompt_token_ids": prompt_ids}, params)

    # ------------------------------------------------------------------ tokenization
    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        check_prompt_text(text, self.max_model_len, self.tokenizer)  # a 400 before a 10 MB text is tokenized
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        chat_template: Optional[str] = None,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> str:
        """The prompt text of a conversation: the request's template, else the server's, else the tokenizer's.

        `tools` (OpenAI's tool definitions) reach the template as `tools`, as transformers and vLLM pass them.
        """
        msgs = normalize_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise BadRequestError(
                "continue_final_message and add_generation_prompt cannot both be true.", param="continue_final_message"
            )
        if continue_final_message and msgs[-1]["role"] != "assistant":
            raise BadRequestError(
                "continue_final_message needs the last message to be from the assistant.", param="messages"
            )
        template = chat_template or self.chat_template
        if not template and not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError(
                "This model has no chat template; pass chat_template or use /v1/completions instead.", param="messages"
            )
        kwargs = dict(chat_template_kwargs or {})
        if template:
            kwargs["chat_template"] = template
        if tools is not None:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except (ValueError, TypeError, KeyError) as e:
            raise BadRequestError(f"Could not apply the chat template: {e}", param="messages") from e
        except Exception as e:  # jinja2 template errors
            raise BadRequestError(
                f"Could not apply the chat template: {type(e).__name__}: {e}", param="messages"
            ) from e
        if not isinstance(text, str):
            raise BadRequestError("The chat template did not render to text.", param="messages")
        return text

    def decode_token(self, token_id: int) -> str:
        try:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        except Exception:
            return ""

    # ------------------------------------------------------------------ running requests
    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: Optional[LoRARequest] = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for one request; leaving early (error, cancel, close) aborts it in the core."""
        tracker = self.metrics.tracker(params.output_kind) if self.metrics is not None else None
        finished = False
        # Only with an adapter: engines (and test fakes) without LoRA keep their plain signature.
        extra = {"lora_request": lora_request} if lora_request is not None else {}
        adapters = self.models if lora_request is not None else None
        if adapters is not None:  # an unload waits for this request before freeing the engine's copy
            adapters.request_started(lora_request)
        try:
            async for out in self.engine.generate(prompt, params, request_id, priority=priority, **extra):
                if tracker is not None:
                    tracker.observe(out)
                finished = out.finished
                yield out
        finally:
            if not finished:
                await shielded(self.engine.abort(request_id))
                if tracker is not None:
                    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
                    tracker.abandoned(len(ids) if ids is not None else 0, params.n)
            if adapters is not None:
                await shielded(adapters.request_ended(lora_request))

    async def refused_before_tokens(
        self, gen: AsyncGenerator[RequestOutput, None], constraint_field: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Wait for a constrained request's first output: an error before any token (the core could not
        compile its grammar) is a 400 naming `constraint_field`; otherwise the same outputs, first included."""
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            return _replay(None, gen)
        except BaseException:
            await shielded(gen.aclose())
            raise
        if first.error and not any(c.token_ids for c in first.outputs):
            await shielded(gen.aclose())
            raise BadRequestError(first.error, param=constraint_field)
        return _replay(first, gen)

    async def all_refused_before_tokens(
        self, gens: list[AsyncGenerator[RequestOutput, None]], constraint_field: str
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """`refused_before_tokens` for several requests at once (all submitted together); any refusal: all close."""
        results = await asyncio.gather(
            *(self.refused_before_tokens(g, constraint_field) for g in gens), return_exceptions=True
        )
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is None:
            return list(results)  # type: ignore[arg-type]
        for r in results:
            if not isinstance(r, BaseException):
                await shielded(r.aclose())
        raise error

    async def abort_all(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            await shielded(self.engine.abort(rid))

    # ------------------------------------------------------------------ logprobs in OpenAI's shapes
    def completion_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[Optional[dict[int, Logprob]]],
        num_logprobs: int,
        initial_text_offset: int = 0,
    ) -> CompletionLogProbs:
        """Legacy completions' parallel lists; an entry of None (a prompt's first token) has no logprob."""
        out = CompletionLogProbs()
        offset = initial_text_offset
        for tid, step in zip(token_ids, logprobs):
            chosen = step.get(tid) if step is not None else None
            token = _token_text(chosen, tid, self)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if step is None or chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(chosen.logprob))
            top: dict[str, float] = {}
            for t, lp in step.items():
                if t == tid or (lp.rank is not None and lp.rank <= num_logprobs):
                    top[_token_text(lp, t, self)] = _finite(lp.logprob)
            out.top_logprobs.append(top)
        return out

    def chat_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], top_logprobs: int
    ) -> ChatCompletionLogProbs:
        """Chat's `content` list: each token with its logprob, UTF-8 bytes and the top-k alternatives."""
        content: list[ChatCompletionLogProbsContent] = []
        for tid, step in zip(token_ids, logprobs):
            chosen = step.get(tid)
            token = _token_text(chosen, tid, self)
            ranked = sorted(
                ((t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= top_logprobs),
                key=lambda x: x[1].rank,  # type: ignore[arg-type, return-value]
            )[:top_logprobs]
            top = []
            for t, lp in ranked:
                text = _token_text(lp, t, self)
                top.append(ChatCompletionLogProb(token=text, logprob=_finite(lp.logprob), bytes=list(text.encode())))
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=_finite(chosen.logprob) if chosen is not None else MIN_LOGPROB,
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)


async def _replay(
    first: Optional[RequestOutput], rest: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    """`first` (when not None), then the rest; closing this closes `rest` (which aborts the request)."""
    try:
        if first is not None:
            yield first
        async for out in rest:
            yield out
    finally:
        await shielded(rest.aclose())


def _load_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's contents when the path exists, else the template text."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template {value!r} is neither an existing file nor Jinja template text.")
    return value


def _finite(x: float) -> float:
    return max(float(x), MIN_LOGPROB) if x == x else MIN_LOGPROB


def _token_text(lp: Optional[Logprob], token_id: int, serving: OpenAIServing) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return serving.decode_token(token_id)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and flatten text content parts into one string per message."""
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list of {role, content} objects.", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequestError(f"messages[{i}] must be an object, got {type(msg).__name__}.", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequestError(f"messages[{i}].role must be a non-empty string, got {role!r}.", param="messages")
        content = msg.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    parts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise BadRequestError(
                        f"messages[{i}].content[{j}]: only text content parts are supported, got {kind!r}.",
                        param="messages",
                    )
            text = "\n".join(parts)
        else:
            raise BadRequestError(
                f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}.",
                param="messages",
            )
        item = with_tool_call_arguments_parsed({k: v for k, v in msg.items() if k not in ("content",)})
        item["content"] = text
        out.append(item)
    return out
