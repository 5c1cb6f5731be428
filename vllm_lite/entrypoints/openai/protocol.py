"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Field names and shapes follow OpenAI's API (and vLLM's extensions such as
`top_k`, `ignore_eos`, `repetition_penalty`), so the official client works
unchanged. Completion and chat requests refuse unknown fields (400 naming them, as
OpenAI's API does); what each known field does is in `field_support.py`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from vllm_lite.client.processor import PRIORITY_MAX, PRIORITY_MIN
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StrictRequestModel(OpenAIBaseModel):
    """A request body typed as OpenAI's schema says: unknown fields and wrong JSON types are a 400.

    ``strict``: no coercion (``"4"`` is not an integer, ``"yes"`` not a boolean, ``2.0`` not an
    integer); an integer still passes where a number is asked for, as in JSON Schema.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


# OpenAI's chat roles; each message needs content except an assistant turn that carries tool calls.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ValueError naming the first message whose role is not OpenAI's or that lacks required content."""
    if not messages:
        raise ValueError("messages must contain at least one message.")
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}.")
        content = message.get("content")
        if content is None:
            if role == "assistant" and (message.get("tool_calls") or message.get("function_call")):
                continue
            needs = "an assistant message needs content or tool_calls" if role == "assistant" else "it is required"
            raise ValueError(f"messages[{i}] ({role}) has no content: {needs}.")
        if not isinstance(content, (str, list)):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of content parts, got {type(content).__name__}."
            )
    return messages


# ---------------------------------------------------------------------------- errors and usage


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)  # no "yes" for true
    include_usage: Optional[bool] = False
    # vLLM's extension: a usage block on every chunk, not only at the end.
    continuous_usage_stats: Optional[bool] = False


# ---------------------------------------------------------------------------- sampling fields shared by both endpoints


class SamplingRequestFields(StrictRequestModel):
    """Fields both endpoints turn into `SamplingParams` (None: the model's or vLLM's default)."""

    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM extensions.
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    # Return the generated (and prompt) token ids alongside the text.
    return_token_ids: bool = False
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=1)
    # Known fields this server refuses unless harmless (field_support.py says why): typed loosely so
    # the refusal names the field instead of a schema error about its shape.
    use_beam_search: Optional[Any] = None
    length_penalty: Optional[Any] = None
    prompt_logprobs: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    # Structured outputs (structured_outputs.py turns them into SamplingParams.structured_outputs).
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    logits_processors: Optional[Any] = None
    return_tokens_as_token_ids: Optional[Any] = None
    cache_salt: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    vllm_xargs: Optional[Any] = None
    prompt_embeds: Optional[Any] = None

    def build_sampling_params(
        self,
        *,
        max_tokens: Optional[int],
        logprobs: Optional[int],
        prompt_logprobs: Optional[int],
        defaults: Optional[SamplingParams],
        stream: bool,
        best_of: Optional[int] = None,
    ) -> SamplingParams:
        """SamplingParams for this request; SamplingParams' own checks raise ValueError/TypeError."""
        base = defaults or SamplingParams()

        def pick(name: str, attr: Optional[str] = None) -> Any:
            value = getattr(self, name)
            return getattr(base, attr or name) if value is None else value

        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        return SamplingParams(
            n=self.n,
            best_of=best_of,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)


# ---------------------------------------------------------------------------- /v1/completions


class CompletionRequest(SamplingRequestFields):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(CompletionResponseChoice):
    """A streamed choice carries the same fields (text is the new piece)."""


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------------- /v1/chat/completions


class ChatCompletionRequest(SamplingRequestFields):
    messages: list[dict[str, Any]]

    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM extensions for the chat template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = False
    # OpenAI platform fields with no effect here (field_support.py: "n/a").
    metadata: Optional[Any] = None
    store: Optional[Any] = None
    service_tier: Optional[Any] = None
    prompt_cache_key: Optional[Any] = None
    safety_identifier: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None
    include_reasoning: Optional[Any] = None
    # Tool calling (tool_choice.py).
    tools: Optional[list[ChatCompletionToolsParam]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoiceParam]] = None
    # Refused unless harmless (field_support.py).
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    verbosity: Optional[Any] = None
    echo: Optional[Any] = None
    best_of: Optional[Any] = None
    documents: Optional[Any] = None
    mm_processor_kwargs: Optional[Any] = None
    request_id: Optional[Any] = None

    @field_validator("messages")
    @classmethod
    def _openai_roles_and_content(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return check_chat_messages(messages)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler: Any) -> Any:
        return _omit_empty(handler(self), "tool_calls")


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: Optional[list[int]] = None


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler: Any) -> Any:
        return _omit_empty(handler(self), "tool_calls")


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None


# ---------------------------------------------------------------------------- models, tokenization


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm-lite"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model (vLLM's card); None for a base model
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(StrictRequestModel):
    """POST /v1/load_lora_adapter (vLLM's body; the route exists with $VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictRequestModel):
    """POST /v1/unload_lora_adapter: by name, or by the id the server gave it (vLLM's body)."""

    lora_name: Optional[str] = None
    lora_int_id: Optional[int] = None


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template) must be given."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---------------------------------------------------------------------------- structured outputs and tools


class JsonSchemaResponseFormat(StrictRequestModel):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is aliased: BaseModel has a `schema`)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=False, validate_by_alias=True)
    name: str
    description: Optional[str] = None
    json_schema: Optional[Union[dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(StrictRequestModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaResponseFormat] = None


class StructuredOutputsRequest(StrictRequestModel):
    """vLLM's `structured_outputs` request object: the fields of `StructuredOutputsParams`."""

    model_config = ConfigDict(extra="forbid", validate_by_name=False, validate_by_alias=True)
    # `json` on the wire (aliased: BaseModel has a `json` method).
    json_schema: Optional[Union[str, dict[str, Any], bool]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None


class FunctionDefinition(StrictRequestModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionToolsParam(StrictRequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(StrictRequestModel):
    name: str


class ChatCompletionNamedToolChoiceParam(StrictRequestModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> Any:
        return _omit_empty(handler(self), "name", "arguments")


class DeltaToolCall(OpenAIBaseModel):
    """One streamed piece of a tool call: the first carries id, type and name; later ones argument text."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> Any:
        return _omit_empty(handler(self), "id", "type", "function")


def _omit_empty(data: Any, *keys: str) -> Any:
    """Leave out these keys when None or empty, as OpenAI's API leaves them out of its bodies."""
    if isinstance(data, dict):
        for key in keys:
            if data.get(key) in (None, []):
                data.pop(key, None)
    return data
