"""User-facing results with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar, Union


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass(slots=True)  # built per request and step: slots halve the construction
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    time_in_queue: Optional[float] = None
    num_generation_tokens: int = 0
    # The engine core's clock (time.monotonic() there): queued, first scheduled, first and last token
    # steps. Differences give vLLM's queue, prefill, decode and inference times.
    queued_ts: Optional[float] = None
    scheduled_ts: Optional[float] = None
    first_token_ts: Optional[float] = None
    last_token_ts: Optional[float] = None


@dataclass(slots=True)  # built per request and step: slots halve the construction
class CompletionOutput:
    """One sampled sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)  # built per request and step: slots halve the construction
class RequestOutput:
    """The output of one request (possibly in progress, when streaming)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None
    kv_transfer_params: None = field(default=None, repr=False)


# ---------------------------------------------------------------------------- pooling (vLLM's names)


@dataclass
class PoolingOutput:
    """The pooled data of one request: a vector (embed, classify) or one row per token (encode, ALL)."""

    data: Any  # torch.Tensor, float32 on the CPU

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolingOutput) and bool((self.data == other.data).all())


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request (`LLM.encode`); `EmbeddingRequestOutput` etc. view it by task."""

    request_id: str
    outputs: Any  # PoolingOutput for `encode`; the task's own output for the subclasses
    prompt_token_ids: list[int]
    finished: bool
    prompt: Optional[str] = None
    error: Optional[str] = None


_TaskRequestOutput = TypeVar("_TaskRequestOutput", bound=PoolingRequestOutput)


def _task_view(cls: type[_TaskRequestOutput], out: PoolingRequestOutput, outputs: Any) -> _TaskRequestOutput:
    """`out` as a task's request output (cls) holding that task's `outputs`; `error` is not carried."""
    return cls(out.request_id, outputs, out.prompt_token_ids, out.finished, out.prompt)


def _vector(pooling_output: PoolingOutput, what: str) -> list[float]:
    """The pooled tensor as a list; anything but a vector is refused, `what` naming it in the message."""
    data = pooling_output.data
    if data.ndim != 1:
        raise ValueError(f"{what} must be a vector, got a tensor of shape {tuple(data.shape)}.")
    return data.tolist()


@dataclass
class EmbeddingOutput:
    """One embedding vector."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "EmbeddingOutput":
        return EmbeddingOutput(_vector(pooling_output, "an embedding"))

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput  # type: ignore[assignment]

    @staticmethod
    def from_base(out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return _task_view(EmbeddingRequestOutput, out, EmbeddingOutput.from_base(out.outputs))


@dataclass
class ClassificationOutput:
    """Class probabilities (or raw scores when the activation is off)."""

    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "ClassificationOutput":
        return ClassificationOutput(_vector(pooling_output, "class scores"))

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput  # type: ignore[assignment]

    @staticmethod
    def from_base(out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return _task_view(ClassificationRequestOutput, out, ClassificationOutput.from_base(out.outputs))


@dataclass
class ScoringOutput:
    """One similarity (embedding models: cosine) or relevance (cross-encoders) score."""

    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> "ScoringOutput":
        data = pooling_output.data
        if data.numel() != 1:
            raise ValueError(f"a score must be one number, got a tensor of shape {tuple(data.shape)}.")
        return ScoringOutput(float(data.reshape(()).item()))


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput  # type: ignore[assignment]

    @staticmethod
    def from_base(out: PoolingRequestOutput) -> "ScoringRequestOutput":
        return _task_view(ScoringRequestOutput, out, ScoringOutput.from_base(out.outputs))
