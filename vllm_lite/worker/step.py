"""What crosses between the scheduler and the worker in one engine step.

`SchedulerOutput` is a diff against the worker's persistent batch (vLLM V1):
new requests come in full; requests already in the batch come only as new
block ids and token counts; finished/preempted ones as ids to drop.
These types live in the worker package so the core depends on the worker,
never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import msgspec

from vllm_lite.lora.request import LoRARequest
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must re-add after preemption)."""

    req_id: str
    # Prompt plus any output tokens generated before a preemption (recompute).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The tokenizer's EOS id; the sampler holds it back while min_tokens is unmet.
    eos_token_id: Optional[int] = None
    # A pooling request (pooling runner): how to pool its hidden states; it is never sampled.
    pooling_params: Optional[PoolingParams] = None
    # Where token type 1 begins in the prompt (a cross-encoder pair; vLLM's name); None: every token type 0.
    compressed_token_type_ids: Optional[int] = None
    # Its LoRA adapter (None: the base model); the worker loads it from lora_path on a miss.
    lora_request: Optional[LoRARequest] = None


@dataclass
class CachedRequestData:
    """Requests already in the worker's batch: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to run this step (prefill chunk or 1 for a decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests to drop from the worker's batch (finished, aborted or preempted).
    finished_req_ids: set[str]
    # Block moves the worker runs before the forward pass: (src, dst) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # device -> host
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # host -> device
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # device -> device
    # Structured outputs: req_id -> its row in grammar_bitmask, for the requests that sample this step
    # under a grammar. grammar_bitmask: int32 [rows, ceil(vocab/32)] (numpy in the core; a tensor once
    # decoded on a TP rank), bit t%32 of word t//32 set = token t allowed. None when no request is constrained.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Optional[Any] = None
    # Speculative decoding (vLLM's name): req_id -> the draft tokens scheduled after its last token this step
    # (num_scheduled_tokens counts them); the runner verifies them in this step's forward pass.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def empty() -> "SchedulerOutput":
        return SchedulerOutput([], CachedRequestData(), {}, 0, set())


class LogprobsTensors(msgspec.Struct, array_like=True):
    """Top-k logprobs for a set of positions, kept as tensors all the way to the frontend.

    logprob_token_ids: int64 [N, k+1]; column 0 is the sampled (or prompt) token.
    logprobs: float32 [N, k+1].
    selected_token_ranks: int64 [N], rank of column 0's token (1 = most likely).
    """

    logprob_token_ids: Any
    logprobs: Any
    selected_token_ranks: Any

    def slice(self, start: int, end: int) -> "LogprobsTensors":
        return LogprobsTensors(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.selected_token_ranks[start:end]
        )


@dataclass
class ModelRunnerOutput:
    # Order of requests in this step's batch.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request: the tokens sampled this step ([] while a prompt is still being prefilled).
    sampled_token_ids: list[list[int]]
    # Rows aligned with req_ids (only rows that sampled are meaningful), or None.
    logprobs: Optional[LogprobsTensors] = None
    # req_id -> prompt logprobs for the prompt positions computed this step.
    prompt_logprobs_dict: dict[str, Optional[LogprobsTensors]] = field(default_factory=dict)
    # Pooling runner (vLLM's name): per request (aligned with req_ids), its pooled float32 tensor on the CPU.
    pooler_output: Optional[list[Optional[Any]]] = None
    # Speculative decoding: per request (aligned with req_ids), the draft tokens proposed for its next step.
    spec_token_ids: Optional[list[list[int]]] = None
    # Set when a request may have emitted several tokens: request i's logprobs are rows
    # logprobs_cu[i] : logprobs_cu[i] + len(sampled_token_ids[i]); None: row i.
    logprobs_cu: Optional[list[int]] = None

    @staticmethod
    def empty() -> "ModelRunnerOutput":
        return ModelRunnerOutput([], {}, [])


class AsyncModelRunnerOutput:
    """A step launched without waiting for its sampled tokens (async scheduling; vLLM's name).

    `get_output()` blocks until the tokens are on the host (CUDA: the event of their copy into pinned memory) and
    returns the step's ModelRunnerOutput, the same the synchronous path returns; later calls return it again.
    The engine reads step N's output before it launches step N+2.
    """

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve: Optional[Callable[[], ModelRunnerOutput]] = resolve
        self._output: Optional[ModelRunnerOutput] = None

    @staticmethod
    def ready(output: ModelRunnerOutput) -> "AsyncModelRunnerOutput":
        """An output already on the host (a step that sampled nothing)."""
        done = AsyncModelRunnerOutput(lambda: output)
        done.get_output()
        return done

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._resolve is not None
            self._output, self._resolve = self._resolve(), None
        return self._output
