"""The engine core's view of one request: token ids and progress, no text."""

from __future__ import annotations

import enum
import time
from typing import Optional, Union

from vllm_lite.core.messages import EngineCoreRequest, FinishReason
from vllm_lite.lora.request import LoRARequest
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.structured_output.request import StructuredOutputRequest

# What a pooling request's worker row samples with (it never does: the pooling runner samples nothing).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute: back in the waiting queue with no blocks
    SWAPPED = 3  # swap: blocks live in host swap space
    WAITING_FOR_FSM = 4  # structured output: its grammar compiles off the step loop; not schedulable yet
    # Everything after this is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[FinishReason]:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Mutable state of a request inside the scheduler."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int],
        arrival_time: float,
        priority: int = 0,
        client_index: int = 0,
        cache_salt: Optional[str] = None,
        tenant_salt: Optional[bytes] = None,
        pooling_params: Optional[PoolingParams] = None,
        compressed_token_type_ids: Optional[int] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # A pooling request runs its prompt once and never samples (vLLM: max_tokens=1); it carries a greedy
        # one-token SamplingParams so the worker's batch rows stay uniform.
        self.pooling_params = pooling_params
        self.compressed_token_type_ids = compressed_token_type_ids  # where token type 1 begins (cross-encoders)
        self.lora_request = lora_request  # its adapter (None: the base model)
        if sampling_params is None:
            if pooling_params is None:
                raise ValueError(f"request {request_id!r}: needs sampling_params or pooling_params.")
            sampling_params = POOLING_SAMPLING_PARAMS
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_index = client_index
        self.cache_salt = cache_salt
        # Set by the engine core from the sending frontend's authenticated identity (never from the wire):
        # prefixes are shared only between requests with equal tenant and cache salts.
        self.tenant_salt = tenant_salt

        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length, set on first schedule
        self.stop_reason: Union[int, str, None] = None
        self.num_preemptions = 0
        self.queued_ts = time.monotonic()  # reported with the first output (request metrics)
        self.scheduled_ts = 0.0  # first time scheduled
        # Max tokens this request may generate (max_tokens, or until max_model_len).
        self.max_tokens = sampling_params.max_tokens
        # Filled by the KV cache manager: hashes of this request's full blocks.
        self.block_hashes: list[bytes] = []
        # Set by the scheduler for a request with structured_outputs: its grammar and matcher.
        self.structured_output_request: Optional[StructuredOutputRequest] = None
        # Speculative decoding: draft tokens proposed after this request's last token, verified at its next step.
        self.spec_token_ids: list[int] = []
        # Set by the scheduler for a model whose rotation switches past this length (Phi-3 LongRoPE, see
        # worker/models/rope_regime.py): past it the request's KV is a different regime, hashed apart.
        self.rope_recompute_at: Optional[int] = None
        # Async scheduling: tokens sampled by steps still in flight, not known here yet (always 0 in sync mode).
        # Position num_tokens + i holds the i-th; the runner feeds it to the next step from its own sampled tensor.
        self.num_output_placeholders = 0

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, tenant_salt: Optional[bytes] = None) -> "Request":
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            client_index=req.client_index,
            cache_salt=req.cache_salt,
            tenant_salt=tenant_salt,
            pooling_params=req.pooling_params,
            compressed_token_type_ids=req.compressed_token_type_ids,
            lora_request=req.lora_request,
        )

    def append_output_token_ids(self, token_ids: Union[int, list[int]]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        was_long = self.uses_long_rope
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.uses_long_rope != was_long:  # its blocks' keys change regime: hashes rebuild from block 0
            self.block_hashes = []

    def append_output_token(self, token_id: int) -> None:
        """One sampled token: append_output_token_ids(token_id), without its rope check where none applies (the
        scheduler's per-token hot path)."""
        if self.rope_recompute_at is not None:
            self.append_output_token_ids(token_id)
            return
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def uses_long_rope(self) -> bool:
        """True once the request is longer than its model's rope switch point (never for other models)."""
        return self.rope_recompute_at is not None and self.num_tokens > self.rope_recompute_at

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> Optional[FinishReason]:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
