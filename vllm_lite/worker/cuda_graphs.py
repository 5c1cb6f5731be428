"""CUDA graphs for decode-only steps (vLLM's "piecewise off, full decode graphs", kept simple).

At start-up, after the KV cache is allocated and bound, the runner captures the model forward once per
padded batch size of a ladder (vLLM's: 1, 2, 4, 8, 16, 24, ... in steps of 8, up to
``max_cudagraph_capture_size``, by default min(max_num_seqs, 256)), every row one query token, into one
shared memory pool. Every tensor the captured forward reads lives in persistent buffers sized for the
largest batch (input ids, positions, slot mapping, seq lens, query start locations, block table with the
full max-blocks-per-request width, each request's known tokens); a graph for batch size B reads their
first B rows. A step replays a graph when each scheduled request runs exactly one token (a decode, or a
one-token prompt) and the batch fits the ladder: its inputs are copied into the buffers, rows B' .. B-1
are padding, and the real rows' hidden states are the first B' rows of the graph's output. Anything else
(a prefill or mixed step, a batch past the largest size, speculative decoding, LoRA, pooling, tensor
parallelism, an attention backend other than Triton) runs eager.

Padding rows are harmless: each has token 0 at position 0, a sequence of length 1 whose block table row
is the null block (block 0, which the block pool reserves and never hands out), and writes its K/V to
slot 0 of that block; its outputs are dropped. The Triton kernels take their grid from the bucket size
and their loop bounds from the seq-lens tensor, so nothing in the captured region reads a host value
that changes per step (``max_query_len`` is 1 for every decode bucket; ``max_seq_len`` is set to the
capacity, max_model_len, and no CUDA kernel reads it).

Memory: the KV cache is sized before the graphs exist (they bind its tensors), so the worker subtracts
an estimate from the KV budget (``estimate_graph_bytes``: the profiled peak activations scaled from the
profiling pass's token count to the largest bucket, plus a fixed allowance per graph); the measured
figure is logged next to it after capture. A capture that fails logs a WARNING and the engine runs eager.

Everything but ``CudaDecodeGraphs`` is plain numpy bookkeeping, tested on CPU (tests/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# vLLM's default cap on captured batch sizes (with max_num_seqs below it, max_num_seqs).
DEFAULT_MAX_CAPTURE_SIZE = 256
# The block pool's reserved null block (block_pool.BlockPool(reserve_null_block=True)): padding rows use it.
NULL_BLOCK = 0
# Fixed device memory assumed per captured graph (graph exec objects, kernel parameters) in the KV reserve.
PER_GRAPH_BYTES = 4 << 20
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------- the ladder
def capture_size_ladder(max_size: int) -> list[int]:
    """vLLM's batch sizes 1, 2, 4, then every multiple of 8, up to ``max_size`` (included even off the ladder)."""
    if max_size < 1:
        return []
    sizes = [s for s in [1, 2, 4, *range(8, max_size + 1, 8)] if s <= max_size]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def resolve_capture_sizes(
    max_num_seqs: int,
    cudagraph_capture_sizes: Optional[Sequence[int]] = None,
    max_cudagraph_capture_size: Optional[int] = None,
) -> list[int]:
    """The batch sizes to capture, ascending: the user's list (vLLM's ``cudagraph_capture_sizes``) or the
    ladder up to ``max_cudagraph_capture_size`` (default 256), never past max_num_seqs (no decode step is
    larger)."""
    cap = max_num_seqs
    if max_cudagraph_capture_size is not None:
        cap = min(cap, max_cudagraph_capture_size)
    if cudagraph_capture_sizes is not None:
        return sorted({int(s) for s in cudagraph_capture_sizes if 1 <= int(s) <= cap})
    return capture_size_ladder(min(cap, DEFAULT_MAX_CAPTURE_SIZE))


def choose_bucket(sizes: Sequence[int], num_reqs: int) -> Optional[int]:
    """The smallest captured size that holds ``num_reqs`` rows (ascending ``sizes``); None: none does."""
    if num_reqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def step_bucket(sizes: Sequence[int], num_scheduled: np.ndarray, has_spec_tokens: bool = False) -> Optional[int]:
    """The graph a step replays, or None to run it eager: only steps where every request runs one token
    (no prefill chunk, no speculative drafts) and the batch fits a captured size."""
    if has_spec_tokens or len(num_scheduled) == 0 or not bool(np.all(num_scheduled == 1)):
        return None
    return choose_bucket(sizes, len(num_scheduled))


def graphs_blocked_reason(
    *,
    device: torch.device,
    enforce_eager: bool,
    backend_name: str,
    tp_size: int = 1,
    lora: bool = False,
    spec_decode: bool = False,
    pooling: bool = False,
    token_types: bool = False,
    has_kv_cache: bool = True,
) -> Optional[str]:
    """Why this engine runs every step eager (None: it captures decode graphs). Conservative by design."""
    if device.type != "cuda":
        return f"device {device.type}"
    if enforce_eager:
        return "enforce_eager=True"
    checks = (
        (backend_name != "triton", f"attention backend {backend_name} (graphs need triton)"),
        (tp_size > 1, "tensor parallelism"),
        (lora, "LoRA enabled"),
        (spec_decode, "speculative decoding"),
        (pooling, "a pooling model"),
        (token_types, "a model that takes token types"),
        (not has_kv_cache, "no KV cache"),
    )
    for blocked, reason in checks:
        if blocked:
            return reason
    return None


def estimate_graph_bytes(peak_activation_bytes: int, profile_tokens: int, sizes: Sequence[int]) -> int:
    """Device memory to hold back from the KV budget for the graphs: the profiling pass's peak activations
    scaled from its ``profile_tokens`` to the largest bucket (activations grow with tokens; the profiled
    peak also holds the sampler's, so this errs high), plus PER_GRAPH_BYTES per graph."""
    if not sizes:
        return 0
    scaled = peak_activation_bytes * min(1.0, max(sizes) / max(1, profile_tokens))
    return int(scaled) + PER_GRAPH_BYTES * len(sizes)


# ---------------------------------------------------------------------------------------------- padding
@dataclass
class PaddedDecode:
    """A decode step's inputs padded to ``bucket`` rows, exactly as the graph for that size reads them."""

    num_real: int
    input_ids: np.ndarray  # int64 [B]
    positions: np.ndarray  # int64 [B]
    slot_mapping: np.ndarray  # int64 [B]
    seq_lens: np.ndarray  # int32 [B]
    query_start_loc: np.ndarray  # int32 [B+1]: 0..B, one token per row
    block_table: np.ndarray  # int32 [B, W]: W = the step's widest row; padding rows all NULL_BLOCK
    num_tokens: np.ndarray  # int32 [B] each request's known tokens

    @property
    def bucket(self) -> int:
        return len(self.input_ids)

    def metadata(
        self, device: torch.device, max_seq_len: int, block_table_width: Optional[int] = None
    ) -> AttentionMetadata:
        """Attention metadata over these arrays on ``device`` (eager use: the CPU tests); the block table is
        widened with null-block columns to ``block_table_width`` when given (the graph buffers' width)."""
        bt = self.block_table
        if block_table_width is not None and block_table_width > bt.shape[1]:
            bt = np.concatenate([bt, np.full((bt.shape[0], block_table_width - bt.shape[1]), NULL_BLOCK, np.int32)], 1)
        qsl, seq = torch.from_numpy(self.query_start_loc.copy()), torch.from_numpy(self.seq_lens.copy())
        return AttentionMetadata(
            num_actual_tokens=self.bucket,
            num_reqs=self.bucket,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=qsl.to(device),
            seq_lens=seq.to(device),
            block_table=torch.from_numpy(np.ascontiguousarray(bt)).to(device),
            slot_mapping=torch.from_numpy(self.slot_mapping.copy()).to(device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
            num_tokens=torch.from_numpy(self.num_tokens.copy()).to(device),
        )


def pad_decode_inputs(inputs: StepInputs, bucket: int, block_size: int) -> PaddedDecode:
    """Pad a one-token-per-request step to ``bucket`` rows; padding rows read and write only the null block."""
    n = inputs.num_reqs
    if bucket < n:
        raise ValueError(f"bucket {bucket} is smaller than the batch ({n} requests).")
    if inputs.num_tokens != n:
        raise ValueError(f"a decode bucket needs one token per request, got {inputs.num_tokens} for {n} requests.")
    null_slot = NULL_BLOCK * block_size
    width = max(1, inputs.block_table.shape[1])

    def padded(values: np.ndarray, fill: int, dtype: type) -> np.ndarray:
        out = np.full(bucket, fill, dtype=dtype)
        out[:n] = values
        return out

    block_table = np.full((bucket, width), NULL_BLOCK, dtype=np.int32)
    block_table[:n, : inputs.block_table.shape[1]] = inputs.block_table
    known = inputs.req_num_tokens if inputs.req_num_tokens is not None else inputs.seq_lens
    return PaddedDecode(
        num_real=n,
        input_ids=padded(inputs.input_ids, 0, np.int64),
        positions=padded(inputs.positions, 0, np.int64),
        slot_mapping=padded(inputs.slot_mapping, null_slot, np.int64),
        seq_lens=padded(inputs.seq_lens, 1, np.int32),
        query_start_loc=np.arange(bucket + 1, dtype=np.int32),
        block_table=block_table,
        num_tokens=padded(known, 1, np.int32),
    )


# ---------------------------------------------------------------------------------------------- CUDA
class CudaDecodeGraphs:
    """The captured decode graphs of one model runner, their persistent input buffers and memory pool."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        sizes: Sequence[int],
        block_size: int,
        max_blocks_per_req: int,
        max_model_len: int,
    ) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.sizes = sorted(sizes)
        self.block_size, self.max_model_len = block_size, max_model_len
        n = max(self.sizes)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # Initialised as padding rows: a warm-up or capture over them touches only the null block.
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), NULL_BLOCK * block_size, **i64)
        self.seq_lens = torch.ones(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.block_table = torch.full((n, max(1, max_blocks_per_req)), NULL_BLOCK, **i32)
        self.num_tokens = torch.ones(n, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def _metadata(self, bucket: int) -> AttentionMetadata:
        """Metadata whose device tensors are views of the persistent buffers (what a graph reads)."""
        return AttentionMetadata(
            num_actual_tokens=bucket,
            num_reqs=bucket,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc_cpu=torch.arange(bucket + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(bucket, dtype=torch.int32),
            num_tokens=self.num_tokens[:bucket],
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        with set_forward_context(self._metadata(bucket), self.backend):
            return self.model(self.input_ids[:bucket], self.positions[:bucket])

    @torch.inference_mode()
    def capture(self, warmup_runs: int = 1) -> None:
        """Capture every size, largest first (the pool grows once; smaller graphs reuse it). Raises on failure
        (the caller logs it and runs eager); graphs captured before the failure are dropped."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        try:
            for bucket in reversed(self.sizes):
                # Warm-up on a side stream, as PyTorch's docs show: Triton compiles, lazy inits and the
                # allocator's first allocations happen outside the capture.
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(warmup_runs):
                        self._forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(bucket)
                self.graphs[bucket], self.outputs[bucket] = graph, out
            torch.cuda.synchronize(self.device)
        except BaseException:
            # torch.cuda.graph's __exit__ leaves its capture stream current when capture_end raises.
            torch.cuda.set_stream(main)
            self.release()
            raise
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def release(self) -> None:
        """Drop every graph, output and the pool (after a failed capture)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except Exception as e:  # pragma: no cover - a capture error CUDA keeps reporting
            logger.debug("after dropping the CUDA graphs: %s", e)

    def run(self, inputs: StepInputs, has_spec_tokens: bool = False) -> Optional[torch.Tensor]:
        """Hidden states [num_reqs, hidden] by replaying a graph, or None when the step must run eager.

        The result is a view of the graph's static output: the next replay overwrites it, so it must be
        consumed (logits, sampling) within the step, which the runner does."""
        bucket = step_bucket(self.sizes, inputs.num_scheduled, has_spec_tokens)
        if bucket is None or bucket not in self.graphs:
            return None
        p = pad_decode_inputs(inputs, bucket, self.block_size)
        width = p.block_table.shape[1]
        if width > self.block_table.shape[1]:
            return None
        # Columns past `width` keep older ids: a row reads only ceil(seq_len / block_size) <= width of them.
        for buf, arr in (
            (self.input_ids[:bucket], p.input_ids),
            (self.positions[:bucket], p.positions),
            (self.slot_mapping[:bucket], p.slot_mapping),
            (self.seq_lens[:bucket], p.seq_lens),
            (self.num_tokens[:bucket], p.num_tokens),
            (self.block_table[:bucket, :width], p.block_table),
        ):
            buf.copy_(torch.from_numpy(arr), non_blocking=True)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: p.num_real]

    def describe(self, reserved_bytes: Optional[int] = None) -> str:
        """The start-up INFO line: sizes, seconds, GiB (and the KV reserve it was sized against)."""
        sizes = self.sizes
        shown = ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
        line = (
            f"CUDA graphs: captured {len(self.graphs)} decode batch sizes [{shown}] in {self.capture_seconds:.2f} s, "
            f"{self.capture_bytes / GiB:.3f} GiB"
        )
        if reserved_bytes is not None:
            line += f" (KV budget reserved {reserved_bytes / GiB:.3f} GiB for them)"
        return line
