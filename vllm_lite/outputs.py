"""User-facing results with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
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


@dataclass
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


@dataclass
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
