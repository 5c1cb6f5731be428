"""The scheduler's end of a pooling request: one step runs its whole prompt, then it finishes with the pooled data."""

from __future__ import annotations

from typing import Optional

from vllm_lite.core.messages import EngineCoreOutput, FinishReason
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.worker.step import ModelRunnerOutput


def finish_pooling_request(req: Request, mro: ModelRunnerOutput, idx: Optional[int]) -> EngineCoreOutput:
    """Mark `req` finished and build its one output: the pooled tensor, or an error when the runner gave none."""
    pooled = None
    if idx is not None and mro.pooler_output is not None and idx < len(mro.pooler_output):
        pooled = mro.pooler_output[idx]
    if pooled is None or req.num_computed_tokens < req.num_prompt_tokens:
        req.status = RequestStatus.FINISHED_ERROR
        return EngineCoreOutput(
            req.request_id,
            [],
            finish_reason=FinishReason.ERROR,
            error="pooling: the model runner returned no pooled output for this request",
        )
    req.status = RequestStatus.FINISHED_STOPPED
    return EngineCoreOutput(
        req.request_id,
        [],
        finish_reason=FinishReason.STOP,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        queued_ts=req.queued_ts,
        scheduled_ts=req.scheduled_ts,
        pooling_output=pooled,
    )
