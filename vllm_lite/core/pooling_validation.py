"""The core's checks on which kind of request its model takes, and on a pooling request's fields."""

from __future__ import annotations

from typing import Any

from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.pooling_params import GENERATE_ON_POOLING, POOLING_ON_GENERATE, PoolingParams


def validate_pooling_request(request: EngineCoreRequest, limits: Any) -> bool:
    """`limits`: the core's RequestLimits. True for a valid pooling request (nothing more to check); False for a sampling request; else ValueError."""
    pooling: Any = request.pooling_params
    has_sampling = request.sampling_params is not None
    _check_token_types(request)
    if pooling is None:
        if limits.runner_type == "pooling":
            raise ValueError(GENERATE_ON_POOLING)
        if not has_sampling:
            raise ValueError("sampling_params must be a SamplingParams, got NoneType.")
        return False
    if has_sampling:
        raise ValueError("a request carries sampling_params or pooling_params, not both.")
    if limits.runner_type != "pooling":
        raise ValueError(POOLING_ON_GENERATE)
    if not isinstance(pooling, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling).__name__}.")
    pooling.verify()
    n = len(request.prompt_token_ids)
    if n > limits.max_model_len:
        raise ValueError(f"prompt_token_ids has {n} tokens, more than max_model_len={limits.max_model_len}.")
    if limits.max_pooling_tokens is not None and n > limits.max_pooling_tokens:
        raise ValueError(
            f"prompt_token_ids has {n} tokens, more than max_num_batched_tokens={limits.max_pooling_tokens}: a "
            "pooling prompt runs whole in one step."
        )
    return True


def _check_token_types(request: EngineCoreRequest) -> None:
    """compressed_token_type_ids: only on a pooling request, an int in 0..prompt length (where type 1 begins)."""
    boundary: Any = request.compressed_token_type_ids
    if boundary is None:
        return
    if request.pooling_params is None:
        raise ValueError("compressed_token_type_ids applies to pooling requests only.")
    n = len(request.prompt_token_ids)
    if not isinstance(boundary, int) or isinstance(boundary, bool) or not 0 <= boundary <= n:
        raise ValueError(
            f"compressed_token_type_ids must be an int in [0, {n}] (the prompt's length), got {boundary!r}."
        )
