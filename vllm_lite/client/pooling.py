"""The frontend's side of pooling requests: build the core request, and turn the core's output into
`PoolingRequestOutput`.

A pooling request has no text to detokenize and one output (its pooled tensor), so it keeps a small
state of its own beside the generate requests' detokenizers in the OutputProcessor.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from vllm_lite.config import ModelConfig
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_lite.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from vllm_lite.pooling_params import POOLING_ON_GENERATE, PoolingParams


def make_pooling_request(
    model_config: ModelConfig,
    request_id: str,
    prompt_ids: list[int],
    params: PoolingParams,
    arrival_time: Optional[float],
    priority: int,
    client_index: int,
    cache_salt: Optional[str],
    compressed_token_type_ids: Optional[int] = None,
) -> EngineCoreRequest:
    """The core request for a pooling prompt: params checked against the model, defaults from its pooler config,
    the prompt truncated as `truncate_prompt_tokens` asks and no longer than max_model_len.
    `compressed_token_type_ids`: where token type 1 begins in `prompt_ids` (a cross-encoder pair), or None."""
    if model_config.runner_type != "pooling":
        raise ValueError(POOLING_ON_GENERATE)
    pc = model_config.pooler_config
    assert pc is not None, "a pooling model's config carries its resolved pooler_config"
    params.verify(hidden_size=_hidden_size(model_config))
    params = params.with_defaults(task="encode", normalize=bool(pc.normalize), activation=pc.activation is not False)
    if params.dimensions is None and pc.dimensions is not None and params.task in ("embed", "encode"):
        params.dimensions = pc.dimensions
    max_len = model_config.max_model_len
    k = params.truncate_prompt_tokens
    if k is not None:
        k = max_len if k == -1 else k
        if k > max_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) must be at most max_model_len ({max_len}).")
        if compressed_token_type_ids is not None:  # the kept tail's types are unchanged
            compressed_token_type_ids = max(0, compressed_token_type_ids - max(0, len(prompt_ids) - k))
        prompt_ids = prompt_ids[-k:]
    if len(prompt_ids) > max_len:
        raise ValueError(
            f"The input is too long: {len(prompt_ids)} tokens, but max_model_len={max_len}. Shorten it, or "
            "pass truncate_prompt_tokens to keep its last tokens."
        )
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling_params=None,
        eos_token_id=None,
        arrival_time=time.time() if arrival_time is None else float(arrival_time),
        priority=priority,
        client_index=client_index,
        cache_salt=cache_salt,
        pooling_params=params,
        compressed_token_type_ids=compressed_token_type_ids,
    )


def _hidden_size(model_config: ModelConfig) -> Optional[int]:
    hf = model_config.hf_config
    size = hf.get("hidden_size") or hf.get("n_embd") or hf.get("d_model")
    return size if isinstance(size, int) else None


class PoolingRequestState:
    """What the frontend tracks for one pooling request until its single output arrives."""

    def __init__(self, request: EngineCoreRequest, prompt: Optional[str], queue: Any = None) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = request.pooling_params
        self.queue = queue
        self.parent_req = None
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)

    def make_output(self, out: EngineCoreOutput) -> PoolingRequestOutput:
        """The caller's output for the core's (final) output; an error output carries no data."""
        data = out.pooling_output
        if data is not None:  # decoded tensors are read-only views of the received message: give the caller its own
            data = data.clone()
        return PoolingRequestOutput(
            request_id=self.request_id,
            outputs=PoolingOutput(data=data) if data is not None else None,
            prompt_token_ids=self.prompt_token_ids,
            finished=out.finish_reason is not None,
            prompt=self.prompt,
            error=out.error or (None if data is not None else _missing_reason(out)),
        )

    def make_aborted(self) -> PoolingRequestOutput:
        return PoolingRequestOutput(self.request_id, None, self.prompt_token_ids, True, self.prompt, "aborted")


def _missing_reason(out: EngineCoreOutput) -> Optional[str]:
    if out.finish_reason == FinishReason.ABORT:
        return "aborted"
    return "the engine returned no pooled output" if out.finish_reason is not None else None
