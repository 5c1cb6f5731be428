"""CUDA graphs for decode and speculative-verify steps (vLLM's "piecewise off, full decode graphs", kept simple).

At start-up, after the KV cache is allocated and bound, the runner captures the model forward once per graph
key (padded batch size B, query length q) into one shared memory pool. Batch sizes follow vLLM's ladder (1, 2,
4, 8, 16, 24, ... in steps of 8, up to ``max_cudagraph_capture_size``, by default min(max_num_seqs, 256)) with
q = 1 (decode steps). With speculative decoding (k = num_speculative_tokens) the runner also captures q = 2 ..
1 + k (a verify step where every request runs its last token and d = q - 1 drafts: vLLM's uniform-decode graphs;
the n-gram proposer and the draft model may propose fewer than k, so every d in 1..k has its graph) for the batch
sizes up to ``MAX_VERIFY_GRAPH_BATCH`` (16; below disable_by_batch_size, and B * q within
max_num_batched_tokens): at larger batches the n-gram budget (draft_budget.py) mostly verifies no drafts, or
drafts of different lengths per request, which run eager.

Every tensor the captured forward reads lives in persistent buffers sized for the largest key (input ids,
positions and slot mapping per token; seq lens, block table with the full max-blocks-per-request width and each
request's known tokens per request; the query start locations, a constant 0, q, 2q, ... buffer per q; with LoRA
each token's adapter slot); a graph for (B, q) reads their first B (or B * q) rows. A step replays a graph when
every scheduled request runs the same number q of tokens (a decode, a verify step whose requests all carry d =
q - 1 drafts, or prefill chunks of q tokens each) and the batch fits a captured size for q: its inputs are
copied into the buffers, rows B' .. B-1 are padding, and the real tokens' hidden states are the first B' * q
rows of the graph's output. Anything else (a prefill or mixed step, drafts of different lengths, a batch past the
largest size, pooling, tensor parallelism, an attention backend other than Triton) runs eager; logits, sampling
and rejection sampling stay outside the graph as in eager steps.

Padding rows are harmless: each runs q tokens 0 at positions 0 .. q-1, a sequence of length q whose block table
row is all the null block (block 0, which the block pool reserves and never hands out), and writes its K/V to
slots p % block_size of that block (with block_size < q two padding tokens share a slot: still only block 0, and
only padding rows read it); its outputs are dropped, and with LoRA its tokens use no adapter (slot -1). The
Triton kernels take their grid from the key (B * q tokens, B requests, max_query_len = q) and their loop bounds
from the seq-lens and query-start tensors, so nothing in the captured region reads a host value that changes per
step (``max_seq_len`` is set to the capacity, max_model_len, and no CUDA kernel reads it).

LoRA (enable_lora): the graphs are captured with the wrapped layers reading a persistent per-token slot buffer
(``LoRAState.token_slots`` points at it while capturing), into which each replayed step copies its tokens' slots
(-1 on padding rows and on requests without an adapter); adapters enter the slot tensors in place
(``LoRALinear.set_slot``: copy_/zero_ into the captured tensors). The Triton shrink/expand kernels read the slots
on the device and take their grid from the token count and slot count, both fixed per key; the SGMV grouping
(argsort, searchsorted) is computed inside the captured region (``ops.set_step_slots`` at the start of each
captured forward), so it is replayed too. A step with no adapter in it replays the same graph with every slot -1
(the kernels then leave every row as the base layer computed it). Without the Triton LoRA kernels (a host-side
plan) LoRA engines run eager.

Memory: the KV cache is sized before the graphs exist (they bind its tensors), so the worker subtracts
an estimate from the KV budget (``estimate_graph_bytes``: the profiled peak activations scaled from the
profiling pass's token count to the largest key's tokens, plus a fixed allowance per graph); the measured
figure is logged next to it after capture. A capture that fails logs a WARNING and the engine runs eager.

Everything but ``CudaDecodeGraphs.capture`` is plain numpy/torch bookkeeping, tested on CPU
(tests/test_cuda_graphs.py, tests/test_cuda_graphs_spec_lora.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# vLLM's default cap on captured batch sizes (with max_num_seqs below it, max_num_seqs).
DEFAULT_MAX_CAPTURE_SIZE = 256
# Verify graphs (q > 1) only up to this batch size: past it drafts rarely are one length for every request.
MAX_VERIFY_GRAPH_BATCH = 16
# The block pool's reserved null block (block_pool.BlockPool(reserve_null_block=True)): padding rows use it.
NULL_BLOCK = 0
# Fixed device memory assumed per captured graph (graph exec objects, kernel parameters) in the KV reserve.
PER_GRAPH_BYTES = 4 << 20
GiB = 1 << 30

GraphKey = tuple[int, int]  # (padded batch size B, query length q): B * q tokens


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


def resolve_graph_keys(
    sizes: Sequence[int],
    num_speculative_tokens: Optional[int] = None,
    max_num_batched_tokens: Optional[int] = None,
    disable_by_batch_size: Optional[int] = None,
    max_verify_batch: int = MAX_VERIFY_GRAPH_BATCH,
) -> list[GraphKey]:
    """Every (B, q) to capture, by tokens descending then q: (B, 1) for each size, and with speculation (k drafts
    at most) (B, q) for q = 2 .. 1 + k at the sizes B <= max_verify_batch, B < disable_by_batch_size (no drafts
    from there on) and B * q <= max_num_batched_tokens (no larger step is scheduled)."""
    keys = [(int(b), 1) for b in sizes]
    k = num_speculative_tokens or 0
    for q in range(2, k + 2):
        for b in sizes:
            if b > max_verify_batch or (disable_by_batch_size is not None and b >= disable_by_batch_size):
                continue
            if max_num_batched_tokens is not None and b * q > max_num_batched_tokens:
                continue
            keys.append((int(b), q))
    return sorted(set(keys), key=lambda key: (-key[0] * key[1], key[1]))


def sizes_by_query_len(keys: Sequence[GraphKey]) -> dict[int, list[int]]:
    """{q: ascending batch sizes captured for q}."""
    out: dict[int, list[int]] = {}
    for b, q in keys:
        out.setdefault(q, []).append(b)
    return {q: sorted(bs) for q, bs in sorted(out.items())}


def choose_bucket(sizes: Sequence[int], num_reqs: int) -> Optional[int]:
    """The smallest captured size that holds ``num_reqs`` rows (ascending ``sizes``); None: none does."""
    if num_reqs < 1:
        return None
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def uniform_query_len(num_scheduled: np.ndarray) -> Optional[int]:
    """q when every request runs the same number q >= 1 of tokens this step, else None."""
    if len(num_scheduled) == 0:
        return None
    q = int(num_scheduled[0])
    if q < 1 or not (num_scheduled == q).all():  # the method, not np.all's Python dispatch (µs a step)
        return None
    return q


def step_graph_key(by_q: dict[int, Sequence[int]], num_scheduled: np.ndarray) -> Optional[GraphKey]:
    """The graph (B, q) a step replays, or None to run it eager: every request runs the same q tokens (a
    decode, or a verify step whose requests all carry q - 1 drafts) and the batch fits a size captured for q."""
    q = uniform_query_len(num_scheduled)
    if q is None or q not in by_q:
        return None
    bucket = choose_bucket(by_q[q], len(num_scheduled))
    return None if bucket is None else (bucket, q)


def step_bucket(sizes: Sequence[int], num_scheduled: np.ndarray) -> Optional[int]:
    """The decode graph (q = 1) a step replays, or None: every request runs one token and the batch fits."""
    key = step_graph_key({1: sizes}, num_scheduled)
    return None if key is None else key[0]


def graphs_blocked_reason(
    *,
    device: torch.device,
    enforce_eager: bool,
    backend_name: str,
    tp_size: int = 1,
    lora: bool = False,
    lora_kernels: bool = True,
    pooling: bool = False,
    token_types: bool = False,
    has_kv_cache: bool = True,
) -> Optional[str]:
    """Why this engine runs every step eager (None: it captures graphs). Conservative by design; speculative
    decoding and LoRA (with its Triton kernels) capture."""
    if device.type != "cuda":
        return f"device {device.type}"
    if enforce_eager:
        return "enforce_eager=True"
    checks = (
        (backend_name != "triton", f"attention backend {backend_name} (graphs need triton)"),
        (tp_size > 1, "tensor parallelism"),
        (lora and not lora_kernels, "LoRA without its Triton kernels (the torch path plans on the host)"),
        (pooling, "a pooling model"),
        (token_types, "a model that takes token types"),
        (not has_kv_cache, "no KV cache"),
    )
    for blocked, reason in checks:
        if blocked:
            return reason
    return None


def lora_kernels_available() -> bool:
    """Whether CUDA LoRA layers run the Triton kernels (device-side slots, capturable) rather than torch_ops."""
    from vllm_lite.lora import ops

    mod = ops._triton_ops()
    return mod is not None and hasattr(mod, "lora_shrink") and getattr(mod, "HAS_TRITON", False)


def estimate_graph_bytes(peak_activation_bytes: int, profile_tokens: int, sizes: Sequence[int]) -> int:
    """Device memory to hold back from the KV budget for the graphs: the profiling pass's peak activations
    scaled from its ``profile_tokens`` to the largest graph's tokens (``sizes``: each graph's token count B * q;
    activations grow with tokens; the profiled peak also holds the sampler's, so this errs high), plus
    PER_GRAPH_BYTES per graph."""
    if not sizes:
        return 0
    scaled = peak_activation_bytes * min(1.0, max(sizes) / max(1, profile_tokens))
    return int(scaled) + PER_GRAPH_BYTES * len(sizes)


# ---------------------------------------------------------------------------------------------- padding
@dataclass
class PaddedDecode:
    """A uniform step's inputs (q tokens per request) padded to ``bucket`` rows, exactly as the graph for (bucket,
    q) reads them."""

    num_real: int
    input_ids: np.ndarray  # int64 [B*q]
    positions: np.ndarray  # int64 [B*q]
    slot_mapping: np.ndarray  # int64 [B*q]
    seq_lens: np.ndarray  # int32 [B]
    query_start_loc: np.ndarray  # int32 [B+1]: 0, q, 2q, ..., B*q
    block_table: np.ndarray  # int32 [B, W]: W = the step's widest row; padding rows all NULL_BLOCK
    num_tokens: np.ndarray  # int32 [B] each request's known tokens
    query_len: int = 1
    lora_slots: Optional[np.ndarray] = None  # int32 [B*q] each token's adapter slot (-1: none), with LoRA

    @property
    def bucket(self) -> int:
        return len(self.seq_lens)

    @property
    def key(self) -> GraphKey:
        return (self.bucket, self.query_len)

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
            num_actual_tokens=len(self.input_ids),
            num_reqs=self.bucket,
            max_query_len=self.query_len,
            max_seq_len=max_seq_len,
            query_start_loc=qsl.to(device),
            seq_lens=seq.to(device),
            block_table=torch.from_numpy(np.ascontiguousarray(bt)).to(device),
            slot_mapping=torch.from_numpy(self.slot_mapping.copy()).to(device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
            num_tokens=torch.from_numpy(self.num_tokens.copy()).to(device),
        )


def pad_decode_inputs(
    inputs: StepInputs, bucket: int, block_size: int, lora_slots: Optional[np.ndarray] = None
) -> PaddedDecode:
    """Pad a step where every request runs the same q tokens to ``bucket`` requests (bucket * q tokens); padding
    rows read and write only the null block, and use no adapter (``lora_slots``: the real tokens' slots)."""
    n = inputs.num_reqs
    if bucket < n:
        raise ValueError(f"bucket {bucket} is smaller than the batch ({n} requests).")
    q = uniform_query_len(inputs.num_scheduled)
    if q is None:
        raise ValueError(
            f"a graph needs the same number of tokens for every request, got {inputs.num_scheduled.tolist()}."
        )
    t, total = n * q, bucket * q
    width = max(1, inputs.block_table.shape[1])

    def padded(values: np.ndarray, fill: Any, size: int, dtype: type) -> np.ndarray:
        out = np.empty(size, dtype=dtype)
        out[: len(values)] = values
        out[len(values) :] = fill
        return out

    pad_pos = np.tile(np.arange(q, dtype=np.int64), bucket - n)  # each padding row: positions 0 .. q-1
    block_table = np.full((bucket, width), NULL_BLOCK, dtype=np.int32)
    block_table[:n, : inputs.block_table.shape[1]] = inputs.block_table
    known = inputs.req_num_tokens if inputs.req_num_tokens is not None else inputs.seq_lens
    slots = None
    if lora_slots is not None:
        if len(lora_slots) != t:
            raise ValueError(f"lora_slots has {len(lora_slots)} entries for {t} tokens.")
        slots = padded(lora_slots, -1, total, np.int32)
    return PaddedDecode(
        num_real=n,
        input_ids=padded(inputs.input_ids, 0, total, np.int64),
        positions=padded(inputs.positions, pad_pos, total, np.int64),
        slot_mapping=padded(inputs.slot_mapping, NULL_BLOCK * block_size + pad_pos % block_size, total, np.int64),
        seq_lens=padded(inputs.seq_lens, q, bucket, np.int32),
        query_start_loc=np.arange(bucket + 1, dtype=np.int32) * q,
        block_table=block_table,
        num_tokens=padded(known, q, bucket, np.int32),
        query_len=q,
        lora_slots=slots,
    )


# ---------------------------------------------------------------------------------------------- CUDA
class CudaDecodeGraphs:
    """The captured graphs of one model runner (decode and verify keys), their persistent input buffers and
    memory pool; with ``lora_state`` the wrapped layers read a persistent per-token slot buffer.

    ``execs_per_key`` > 1 captures each key that many times and replays the copies in turn, so that under async
    scheduling a step never launches the very graph exec the step before it launched and is still running (an
    A/B knob for scripts/async_b1_phases.py; copies share the pool and the input buffers, each has its own
    output)."""

    execs_per_key: int = 1

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        sizes: Sequence[int],
        block_size: int,
        max_blocks_per_req: int,
        max_model_len: int,
        keys: Optional[Sequence[GraphKey]] = None,
        lora_state: Optional[Any] = None,
    ) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.keys: list[GraphKey] = (
            list(keys) if keys is not None else sorted(((int(b), 1) for b in sizes), key=lambda k: -k[0])
        )
        self.by_q = sizes_by_query_len(self.keys)
        self.sizes = self.by_q.get(1, [])  # the decode batch sizes
        self.block_size, self.max_model_len = block_size, max_model_len
        self.lora_state = lora_state
        n = max(b for b, _ in self.keys)
        t = max(b * q for b, q in self.keys)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # Initialised as padding rows of the longest q: a warm-up or capture over them touches only the null block.
        q_max = max(self.by_q)
        pad_pos = torch.arange(t, **i64) % q_max
        # The per-token and per-request buffers are views of one packed byte buffer (int64 input ids, positions,
        # slot mapping; then int32 seq lens, known token counts, LoRA slots): `run` fills them with one copy.
        self._max_tokens, self._max_reqs = t, n
        self._i64_bytes = 3 * t * 8
        i32_len = 2 * n + (t if lora_state is not None else 0)
        self.packed = torch.zeros(self._i64_bytes + 4 * i32_len, dtype=torch.uint8, device=device)
        p64 = self.packed[: self._i64_bytes].view(torch.int64)
        p32 = self.packed[self._i64_bytes :].view(torch.int32)
        self.input_ids = p64[:t]
        self.positions = p64[t : 2 * t]
        self.positions.copy_(pad_pos)
        self.slot_mapping = p64[2 * t :]
        self.slot_mapping.copy_(NULL_BLOCK * block_size + pad_pos % block_size)
        self.seq_lens = p32[:n]
        self.seq_lens.fill_(q_max)
        self.num_tokens = p32[n : 2 * n]
        self.num_tokens.fill_(q_max)
        self.lora_slots = p32[2 * n :].fill_(-1) if lora_state is not None else None
        # Constant per q (never written after this): 0, q, 2q, ...
        self.query_start_loc = {q: torch.arange(n + 1, **i32) * q for q in self.by_q}
        self.block_table = torch.full((n, max(1, max_blocks_per_req)), NULL_BLOCK, **i32)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        # Further execs of a key (execs_per_key > 1): (graph, output) each, replayed in turn after self.graphs'.
        self.spares: dict[GraphKey, list[tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {}
        self._turn: dict[GraphKey, int] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        # run's per-step views of the persistent buffers, per (bucket, q, block-table width): (packed bytes the step
        # writes, block table [:bucket, :width], input ids [:bucket * q]); a torch slice is ~1-2 µs of host time.
        self._step_views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _metadata(self, key: GraphKey) -> AttentionMetadata:
        """Metadata whose device tensors are views of the persistent buffers (what a graph reads)."""
        b, q = key
        # No CUDA kernel reads the host copies; on CPU (the tests' stand-in graphs) the buffers are host tensors.
        on_host = self.device.type == "cpu"
        return AttentionMetadata(
            num_actual_tokens=b * q,
            num_reqs=b,
            max_query_len=q,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[q][: b + 1],
            seq_lens=self.seq_lens[:b],
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[: b * q],
            query_start_loc_cpu=torch.arange(b + 1, dtype=torch.int32) * q,
            seq_lens_cpu=self.seq_lens[:b] if on_host else torch.full((b,), q, dtype=torch.int32),
            num_tokens=self.num_tokens[:b],
        )

    def _forward(self, key: GraphKey) -> torch.Tensor:
        b, q = key
        if self.lora_state is None:
            with set_forward_context(self._metadata(key), self.backend):
                return self.model(self.input_ids[: b * q], self.positions[: b * q])
        from vllm_lite.lora import ops

        assert self.lora_slots is not None
        slots = self.lora_slots[: b * q]
        # The layers read the persistent slots; declaring them here puts the SGMV grouping inside the capture.
        self.lora_state.token_slots = slots
        ops.set_step_slots(slots)
        try:
            with set_forward_context(self._metadata(key), self.backend):
                return self.model(self.input_ids[: b * q], self.positions[: b * q])
        finally:
            self.lora_state.token_slots = None  # eager steps set their own (LoRAModelManager.prepare_step)
            ops.set_step_slots(None)

    @torch.inference_mode()
    def capture(self, warmup_runs: int = 1) -> None:
        """Capture every key, most tokens first (the pool grows once; smaller graphs reuse it). Raises on failure
        (the caller logs it and runs eager); graphs captured before the failure are dropped."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        try:
            for key in sorted(self.keys, key=lambda k: (-k[0] * k[1], k[1])):
                # Warm-up on a side stream, as PyTorch's docs show: Triton compiles, lazy inits and the
                # allocator's first allocations happen outside the capture.
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(warmup_runs):
                        self._forward(key)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(key)
                self.graphs[key], self.outputs[key] = graph, out
                for _ in range(self.execs_per_key - 1):
                    spare = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(spare, pool=self.pool):
                        spare_out = self._forward(key)
                    self.spares.setdefault(key, []).append((spare, spare_out))
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
        self.spares.clear()
        self._turn.clear()
        self.pool = None
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        except Exception as e:  # pragma: no cover - a capture error CUDA keeps reporting
            logger.debug("after dropping the CUDA graphs: %s", e)

    def run(
        self,
        inputs: StepInputs,
        lora_slots: Optional[np.ndarray] = None,
        fix: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        host: Optional[Callable[[np.ndarray], torch.Tensor]] = None,
    ) -> Optional[torch.Tensor]:
        """Hidden states [num_tokens, hidden] by replaying a graph, or None when the step must run eager.

        ``lora_slots``: int32 [num_tokens] each token's adapter slot (-1: none), or None (no adapter this step;
        a LoRA engine's graphs then run with every slot -1). The result is a view of the graph's static output:
        the next replay overwrites it, so it must be consumed (logits, sampling) within the step, which the
        runner does.

        Async scheduling: ``fix`` = (token indices, token ids), both on the device: tokens whose ids the previous
        step sampled and the host does not hold yet (its inputs carry a placeholder there); they are written into
        the persistent input-ids buffer after the step's inputs (one index_copy_ on the device, no host read).
        ``host`` stages each array in pinned memory (PinnedRing.host) so the copies never wait for the device."""
        key = step_graph_key(self.by_q, inputs.num_scheduled)
        if key is None or key not in self.graphs:
            return None
        bucket, q = key
        if self.lora_slots is not None and lora_slots is None:
            lora_slots = np.full(inputs.num_tokens, -1, dtype=np.int32)
        if self.lora_slots is not None and lora_slots is not None and len(lora_slots) != inputs.num_tokens:
            raise ValueError(f"lora_slots has {len(lora_slots)} entries for {inputs.num_tokens} tokens.")
        width = max(1, inputs.block_table.shape[1])
        if width > self.block_table.shape[1]:
            return None
        packed, block_table = self.pack_step(inputs, bucket, q, lora_slots if self.lora_slots is not None else None)
        views = self._step_views.get((bucket, q, width))
        if views is None or len(views[0]) != len(packed):
            t = bucket * q
            views = self._step_views[(bucket, q, width)] = (
                self.packed[: len(packed)],
                self.block_table[:bucket, :width],
                self.input_ids[:t],
            )
        views[0].copy_(torch.from_numpy(packed) if host is None else host(packed), non_blocking=True)
        # Columns past `width` keep older ids: a row reads only ceil(seq_len / block_size) <= width of them.
        views[1].copy_(torch.from_numpy(block_table) if host is None else host(block_table), non_blocking=True)
        if fix is not None:  # real rows only: every index < num_real * q, padding untouched
            views[2].index_copy_(0, fix[0], fix[1])
        turn = self._next_turn(key)
        if turn == 0:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            spare, out = self.spares[key][turn - 1]
            spare.replay()
        real = inputs.num_reqs * q
        return out if len(out) == real else out[:real]  # a full bucket: the output itself (no slice)

    def _next_turn(self, key: GraphKey) -> int:
        """Which exec of `key` replays now: 0 (self.graphs'), or i for spares[key][i - 1], the copies in turn."""
        spares = self.spares.get(key)
        if not spares:
            return 0
        turn = self._turn[key] = (self._turn.get(key, 0) + 1) % (len(spares) + 1)
        return turn

    def pack_step(
        self, inputs: StepInputs, bucket: int, q: int, lora_slots: Optional[np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(packed, block table): the step padded to `bucket` requests of q tokens as pad_decode_inputs pads it,
        written straight into `packed`'s layout up to the last byte the step writes (one copy), and the padded
        block table [bucket, width].

        Each array fills the head of its region (t = bucket * q tokens, `bucket` requests); the rest of a region,
        which this graph does not read (it reads [:t] and [:bucket]; every graph writes its own before it
        replays), is zeros."""
        T, N = self._max_tokens, self._max_reqs
        n = inputs.num_reqs
        real, t = n * q, bucket * q
        end = self._i64_bytes + 4 * (2 * N + t if self.lora_slots is not None else N + bucket)
        out = np.zeros(end, dtype=np.uint8)
        h64 = out[: self._i64_bytes].view(np.int64)
        h64[:real] = inputs.input_ids  # padding rows: token 0
        h64[T : T + real] = inputs.positions
        h64[2 * T : 2 * T + real] = inputs.slot_mapping
        if bucket > n:  # each padding row: positions 0 .. q-1, in the null block
            pad_pos = np.tile(np.arange(q, dtype=np.int64), bucket - n)
            h64[T + real : T + t] = pad_pos
            h64[2 * T + real : 2 * T + t] = NULL_BLOCK * self.block_size + pad_pos % self.block_size
        h32 = out[self._i64_bytes :].view(np.int32)
        known = inputs.req_num_tokens if inputs.req_num_tokens is not None else inputs.seq_lens
        h32[:n] = inputs.seq_lens
        h32[n:bucket] = q
        h32[N : N + n] = known
        h32[N + n : N + bucket] = q
        if self.lora_slots is not None:
            h32[2 * N : 2 * N + t] = -1
            if lora_slots is not None:
                h32[2 * N : 2 * N + real] = lora_slots
        w = inputs.block_table.shape[1]
        block_table = np.empty((bucket, max(1, w)), dtype=np.int32)  # every entry written below (np.full: slower)
        block_table[:n, :w] = inputs.block_table
        if w < 1:
            block_table[:n] = NULL_BLOCK
        block_table[n:] = NULL_BLOCK
        return out, block_table

    def describe(self, reserved_bytes: Optional[int] = None) -> str:
        """The start-up INFO line: sizes per q, seconds, GiB (and the KV reserve it was sized against)."""

        def shown(sizes: Sequence[int]) -> str:
            return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"

        captured = sizes_by_query_len(list(self.graphs))
        decode = captured.get(1, [])
        line = f"CUDA graphs: captured {len(decode)} decode batch sizes [{shown(decode)}]"
        verify = {q: bs for q, bs in captured.items() if q > 1}
        if verify:
            qs = sorted(verify)
            same = all(verify[q] == verify[qs[0]] for q in qs)
            if same:
                line += f", verify steps q={qs[0]}..{qs[-1]} at batch sizes [{shown(verify[qs[0]])}]"
            else:
                line += ", verify steps " + "; ".join(f"q={q} at [{shown(verify[q])}]" for q in qs)
        if self.lora_state is not None:
            line += " (LoRA slots in the graphs)"
        if self.spares:
            line += f" ({1 + max(len(v) for v in self.spares.values())} execs a key, replayed in turn)"
        line += f": {len(self.graphs)} graphs in {self.capture_seconds:.2f} s, {self.capture_bytes / GiB:.3f} GiB"
        if reserved_bytes is not None:
            line += f" (KV budget reserved {reserved_bytes / GiB:.3f} GiB for them)"
        return line
