"""GPUModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

A step reads top-down: apply the scheduler's diff to the persistent `InputBatch`
(which owns the rows' sampling state too), build the flattened inputs with numpy
(`step_inputs`), copy them to the device once, run the model under the step's
forward context, sample only the rows whose prompt is complete, build the output.
`profile_run` runs the same path once at the largest shapes, for KV-cache sizing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from vllm_lite.config import VllmConfig
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker import sampler as sampler_module
from vllm_lite.worker.attention.backend import AttentionBackend
from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.compile import maybe_compile
from vllm_lite.worker.cuda_graphs import (
    CudaDecodeGraphs,
    estimate_graph_bytes,
    graphs_blocked_reason,
    lora_kernels_available,
    resolve_capture_sizes,
    resolve_graph_keys,
)
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.host_staging import PinnedRing, SampledRing
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.kv_cache_sizing import measure_peak_allocated
from vllm_lite.worker.lora_step import lora_call, make_lora_manager, register_new_loras
from vllm_lite.worker.model_loader import load_model
from vllm_lite.worker.models.cpu_prepack import linear, maybe_prepack
from vllm_lite.worker.models.decoder import CausalLM
from vllm_lite.worker.models.vocab_parallel import VocabParallelEmbedding
from vllm_lite.worker.parallel_state import broadcast_from_driver, get_tp_rank, get_tp_size
from vllm_lite.worker.pooler import make_pooler, pool_step, step_pooling_params
from vllm_lite.worker.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from vllm_lite.worker.spec_decode_step import (
    SMALL_BATCH,
    SpecDecodeStep,
    changes_argmax,
    record_emitted,
    record_emitted_lists,
)
from vllm_lite.worker.step import (
    AsyncModelRunnerOutput,
    LogprobsTensors,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from vllm_lite.worker.step_inputs import StepInputs, build_step_inputs
from vllm_lite.worker.token_types import build_token_type_ids, step_token_type_boundaries, takes_token_type_ids

logger = logging.getLogger(__name__)


def _get_backend(device: torch.device) -> AttentionBackend:
    from vllm_lite.worker.attention.selector import get_attn_backend

    return get_attn_backend(device)


class GPUModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.config = vllm_config
        self.device = device
        mc = vllm_config.model_config
        self.dtype = mc.dtype
        self.max_model_len = mc.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)

        t0 = time.perf_counter()
        self.model = load_model(mc, device)
        maybe_prepack(self.model, device, self.dtype, batch_hint=min(self.max_num_reqs, 64))
        maybe_compile(self.model, vllm_config)  # compilation_config (vLLM's); eager unless asked
        self.lora_manager = make_lora_manager(vllm_config, self.model, device)  # None without enable_lora
        self.load_time_s = time.perf_counter() - t0
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.takes_token_types = takes_token_type_ids(self.model)  # BERT: cross-encoder pairs carry token types
        self.vocab_size = mc.vocab_size
        self.backend = _get_backend(device)
        self.sampler = Sampler()
        self._sampling_head = _sampling_head(self.model, device, self.dtype)  # None: compute_logits as ever
        self.pooler = make_pooler(mc, self.model)  # a pooling model pools instead of sampling
        self.spec_decode = SpecDecodeStep.maybe_create(vllm_config, device, self.backend)  # None: no speculation
        self.tp_size, self.is_driver = get_tp_size(), get_tp_rank() == 0
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, self.vocab_size, device
        )
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] = []
        self.cudagraph_sizes = self._cudagraph_sizes()  # [] : every step eager (always so off CUDA)
        self.cudagraph_keys = self._cudagraph_keys()  # (batch, query len): decode and speculative verify graphs
        self.cuda_graphs: Optional[CudaDecodeGraphs] = None  # set by capture_cuda_graphs once the KV cache exists
        self.cuda_graph_reserved: Optional[int] = None  # what the KV budget left for them (profiled CUDA budgets)
        # Reused host buffers for step inputs (no per-step allocation of large arrays).
        self._arange = np.arange(max(self.max_num_tokens, self.max_model_len) + 1, dtype=np.int64)
        self._init_async(vllm_config)

    # ------------------------------------------------------------------ async scheduling
    def _init_async(self, vllm_config: VllmConfig) -> None:
        """Async scheduling (scheduler_config.async_scheduling): `execute_model(so, non_block=True)` launches a
        step and returns before its tokens are on the host; the next step takes its input ids from the previous
        step's sampled tensor on the device. Off: nothing here is used (every step as before)."""
        self.async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self._step_id = 0
        self._prev: Optional[_LaunchedStep] = None  # the last step launched with non_block=True
        self._staging: Optional[PinnedRing] = None
        self._sampled_ring: Optional[SampledRing] = None
        self._dev_arange: Optional[torch.Tensor] = None  # _device_arange's
        self._dev_arange_k: Optional[torch.Tensor] = None  # its last answer, a view of it
        # The last step's (request ids, req_id_to_index): the steady decode step reports the same requests in the
        # same order, so the dict is handed out again (its readers only read it) instead of rebuilt (~9 µs at 256).
        self._req_index: Optional[tuple[list[str], dict[str, int]]] = None
        if not self.async_scheduling:
            return
        if self.spec_decode is not None or self.tp_size > 1 or self.pooler is not None:
            raise ValueError("async scheduling does not support speculative decoding, tensor parallelism or pooling")
        self._staging = PinnedRing(self.device)
        self._sampled_ring = SampledRing(self.device, self.max_num_reqs)
        if self.device.type == "cuda":  # pageable copies would wait for the step in flight
            self.input_batch.sampling.stage = self._staging.stage

    def _stage(self) -> Optional[Any]:
        """The pinned-staging copy for this runner's host arrays (CUDA, async scheduling), else None."""
        return self._staging.stage if self._staging is not None and not self._staging.passthrough else None

    def _h2d(self, arr: np.ndarray, non_blocking: bool) -> torch.Tensor:
        stage = self._stage()
        if stage is not None:
            return stage(arr)
        return torch.from_numpy(arr).to(self.device, non_blocking=non_blocking)

    # ------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        target = sum(2 * self.block_size * a.num_kv_heads * a.head_size * elem for a in self.attn_layers)
        draft = self.spec_decode.draft if self.spec_decode is not None else None
        return target + (draft.kv_cache_bytes_per_block() if draft is not None else 0)  # one block id, both caches

    def initialize_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate one [2, blocks, block_size, kv_heads, head_size] tensor per layer and bind it."""
        if self.cuda_graphs is not None:  # captured over the old tensors: recapture after this
            self.cuda_graphs.release()
            self.cuda_graphs = None
        self.kv_caches = []
        for layer in self.attn_layers:
            shape = (2, num_gpu_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        self.swap_caches = (
            [
                torch.zeros(
                    (2, num_cpu_blocks, self.block_size, a.num_kv_heads, a.head_size),
                    dtype=self.dtype,
                    device="cpu",
                    pin_memory=self.device.type == "cuda",
                )
                for a in self.attn_layers
            ]
            if num_cpu_blocks > 0
            else []
        )
        if self.spec_decode is not None and self.spec_decode.draft is not None:  # same block ids, its own tensors
            caches, swaps = self.spec_decode.draft.allocate_kv_cache(num_gpu_blocks, num_cpu_blocks)
            self.kv_caches += caches
            self.swap_caches += swaps

    # ------------------------------------------------------------------ CUDA graphs (cuda_graphs.py)
    def _cudagraph_sizes(self) -> list[int]:
        """The decode batch sizes to capture; [] where graphs are off (CPU, enforce_eager, anything unusual)."""
        cfg = self.config
        lora = self.lora_manager is not None
        reason = graphs_blocked_reason(
            device=self.device,
            enforce_eager=cfg.model_config.enforce_eager,
            backend_name=self.backend.name,
            tp_size=self.tp_size,
            lora=lora,
            lora_kernels=lora and self.device.type == "cuda" and lora_kernels_available(),
            pooling=self.pooler is not None,
            token_types=self.takes_token_types,
            has_kv_cache=bool(self.attn_layers),
        )
        cc = cfg.compilation_config
        sizes = resolve_capture_sizes(self.max_num_reqs, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size)
        if reason is not None or not sizes:
            if self.device.type == "cuda":
                logger.info("CUDA graphs off: %s; every step runs eager", reason or "no capture sizes")
            return []
        return sizes

    def _cudagraph_keys(self) -> list[tuple[int, int]]:
        """Every (batch size, query length) to capture: the decode sizes with q = 1, and with speculative decoding
        q = 2 .. 1 + num_speculative_tokens at the small ones (cuda_graphs.resolve_graph_keys)."""
        if not self.cudagraph_sizes:
            return []
        sc = self.config.speculative_config
        return resolve_graph_keys(
            self.cudagraph_sizes,
            sc.num_speculative_tokens if sc is not None and self.spec_decode is not None else None,
            self.max_num_tokens,
            sc.disable_by_batch_size if sc is not None else None,
        )

    def cuda_graph_reserve_bytes(self, peak_activation_bytes: int) -> int:
        """Bytes the KV budget leaves for the graphs (0 without them), from the profiling pass's peak."""
        profile_tokens = min(self.max_num_tokens, self.max_num_reqs * self.max_model_len)
        tokens = [b * q for b, q in self.cudagraph_keys]  # each graph's token count
        self.cuda_graph_reserved = estimate_graph_bytes(peak_activation_bytes, profile_tokens, tokens)
        return self.cuda_graph_reserved

    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs over the bound KV cache; a failure logs a WARNING and leaves the runner eager."""
        if not self.cudagraph_sizes or not self.kv_caches:
            return
        graphs = CudaDecodeGraphs(
            self.model,
            self.backend,
            self.device,
            self.cudagraph_sizes,
            self.block_size,
            self.max_blocks_per_req,
            self.max_model_len,
            keys=self.cudagraph_keys or None,  # None: the decode sizes alone
            lora_state=self.lora_manager.state if self.lora_manager is not None else None,
        )
        try:
            graphs.capture()
        except Exception as e:
            logger.warning("CUDA graph capture failed, running eager: %s: %s", type(e).__name__, e)
            if self.spec_decode is not None:  # no verify graphs: speculative steps stop padding for them
                self.spec_decode.set_verify_graphs(None)
            return
        self.cuda_graphs = graphs
        if self.spec_decode is not None:  # the verify graphs captured ({q: batch sizes}): uniform steps pad to them
            self.spec_decode.set_verify_graphs(graphs.by_q)
        logger.info(graphs.describe(self.cuda_graph_reserved))

    # ------------------------------------------------------------------ profiling
    @torch.inference_mode()
    def profile_run(self) -> int:
        """Run one step at the largest shapes the scheduler can build and return its peak activation
        bytes (CUDA; 0 elsewhere).

        max_num_batched_tokens (at most max_model_len each) are spread over max_num_seqs requests that
        all sample, through the real step path on a scratch batch and a scratch KV cache that are
        dropped afterwards, so the runner's batch, its cache binding and the RNG streams are unchanged.
        """
        num_tokens = min(self.max_num_tokens, self.max_num_reqs * self.max_model_len)
        num_reqs = min(self.max_num_reqs, num_tokens)
        per_req = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        per_req[: num_tokens % num_reqs] += 1
        blocks = -(-per_req // self.block_size)
        longest = int(per_req.max())
        batch = InputBatch(num_reqs, longest + 1, -(-(longest + 1) // self.block_size), self.vocab_size, self.device)
        # Sampling that sorts the whole vocabulary: the sampler's largest working set.
        params = SamplingParams(temperature=1.0, top_p=0.95)
        first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
        for i in range(num_reqs):
            batch.add_request(
                NewRequestData(
                    req_id=f"profile-{i}",
                    prompt_token_ids=[0] * int(per_req[i]),
                    output_token_ids=[],
                    sampling_params=params,
                    block_ids=list(range(int(first_block[i]), int(first_block[i] + blocks[i]))),
                    num_computed_tokens=0,
                )
            )
        scheduled = {f"profile-{i}": int(per_req[i]) for i in range(num_reqs)}
        bound = [layer.kv_cache for layer in self.attn_layers]
        rng_devices = [self.device.index or 0] if self.device.type == "cuda" else []
        try:
            for layer in self.attn_layers:
                layer.kv_cache = torch.zeros(
                    (2, int(blocks.sum()), self.block_size, layer.num_kv_heads, layer.head_size),
                    dtype=self.dtype,
                    device=self.device,
                )
            with torch.random.fork_rng(devices=rng_devices, device_type=self.device.type):
                with measure_peak_allocated(self.device) as peak:
                    self._run_step(batch, scheduled)
        finally:
            for layer, cache in zip(self.attn_layers, bound):
                layer.kv_cache = cache
        return peak.peak_bytes

    # ------------------------------------------------------------------ state diff
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the persistent batch (which keeps the sampling rows in step)."""
        batch = self.input_batch
        register_new_loras(self.lora_manager, so.scheduled_new_reqs)
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # re-sent after preemption without a finish notice
            batch.add_request(new)
        cached = so.scheduled_cached_reqs
        batch.update_requests(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)

    def lora_call(self, method: str, *args: Any) -> Any:
        """vLLM's worker LoRA API (add_lora, remove_lora, list_loras, pin_lora), on this runner's adapters."""
        return lora_call(self.lora_manager, method, *args)

    def _move_blocks(self, so: SchedulerOutput) -> None:
        if so.blocks_to_swap_out:
            self.backend.swap_blocks(
                self.kv_caches, self.swap_caches, torch.tensor(so.blocks_to_swap_out, dtype=torch.int64)
            )
        if so.blocks_to_swap_in:
            self.backend.swap_blocks(
                self.swap_caches, self.kv_caches, torch.tensor(so.blocks_to_swap_in, dtype=torch.int64)
            )
        if so.blocks_to_copy:
            stage = self._stage()
            pairs = (
                torch.tensor(so.blocks_to_copy, dtype=torch.int64, device=self.device)
                if stage is None
                else stage(np.asarray(so.blocks_to_copy, dtype=np.int64).reshape(-1, 2))
            )
            self.backend.copy_blocks(self.kv_caches, pairs)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> Any:
        """One step. `non_block` (async scheduling): launch it and return an AsyncModelRunnerOutput whose
        get_output() waits for the sampled tokens; the engine calls get_output() of step N before it launches
        step N+2, and launches a blocking step only with nothing in flight."""
        if non_block and not self.async_scheduling:
            raise ValueError("execute_model(non_block=True) needs scheduler_config.async_scheduling")
        if not self.async_scheduling:
            return self._execute(so, False)
        assert self._staging is not None
        self._staging.begin_step()
        if not non_block:  # nothing may be in flight; a step that still is gets read here, not raced
            self._resolve_prev()
        try:
            return self._execute(so, non_block)
        finally:
            self._staging.record()  # after the step's last copy from the slot's pinned arrays

    def _execute(self, so: SchedulerOutput, non_block: bool) -> Any:
        self._update_states(so)
        self._move_blocks(so)
        if self.spec_decode is not None:
            self.spec_decode.forget(so.finished_req_ids)
        if so.scheduled_spec_decode_tokens:
            SpecDecodeStep.write_drafts(self.input_batch, so)
        if so.total_num_scheduled_tokens == 0:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput.empty()) if non_block else ModelRunnerOutput.empty()
        return self._run_step(self.input_batch, so.num_scheduled_tokens, so, non_block)

    def _resolve_prev(self) -> None:
        """Wait for the last launched step's tokens and write them into the batch (if not done already)."""
        if self._prev is not None:
            self._prev.tokens_on_host()

    def _prev_token_fix(self, batch: InputBatch, inputs: StepInputs) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(token index in this step, index in the previous step's sampled tensor) of every scheduled token whose
        id the previous step sampled and the host does not hold yet; host metadata only, no token values."""
        prev = self._prev
        if prev is None or prev.tokens is not None:
            return None
        pos = batch.pending_rows(inputs.rows, prev.step_id)
        hit = (pos >= 0).nonzero()[0]
        if len(hit) == 0:
            return None
        off = pos[hit] - inputs.num_computed[hit]
        if off.min() < 0:
            raise RuntimeError(
                f"requests {[inputs.req_ids[i] for i in hit[off < 0]]} were computed past a token of step "
                f"{prev.step_id} that is not known yet"
            )
        here = off < inputs.num_scheduled[hit]  # a row may run without reaching its pending token (not sampled)
        if not here.all():
            hit, off = hit[here], off[here]
            if len(hit) == 0:
                return None
        dst = inputs.query_start_loc[hit] + off
        return dst, batch.pending_sources(inputs.rows[hit], prev.step_id)

    def _fix_on_device(
        self, dst: np.ndarray, src: np.ndarray, sampled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """_prev_token_fix's (token indices, indices into the previous step's sampled tensor) as (token indices,
        token ids) on the device. The steady decode step has both ranges 0..k-1 (every token is the previous step's
        sample of the same row, rows in the same order): then a device arange (cached per k) and `sampled` itself
        (or a view) stand in for two host-to-device copies and a gather; anything else is copied and gathered.
        `dst` rises strictly from >= 0 (a token index in each hit request's own query range, requests in order),
        so it is 0..k-1 exactly when its last entry is k - 1."""
        k = len(dst)
        dst_t = self._device_arange(k) if not k or dst[-1] == k - 1 else self._h2d(dst, True)  # k = 0: no entry
        if (src == self._arange[:k]).all():
            return dst_t, sampled if len(sampled) == k else sampled[:k]
        return dst_t, sampled.index_select(0, self._h2d(src, True))

    def _device_arange(self, k: int) -> torch.Tensor:
        """0..k-1 int64 on the device: a view of one arange made once (a launch, no copy from the host), the last
        k's view kept (a slice is a torch call, ~µs of host time a step on CUDA)."""
        last = self._dev_arange_k
        if last is not None and len(last) == k:
            return last
        dev = self._dev_arange
        if dev is None or len(dev) < k:
            dev = self._dev_arange = torch.arange(max(k, len(self._arange)), dtype=torch.int64, device=self.device)
        self._dev_arange_k = dev[:k]
        return self._dev_arange_k

    def _run_step(
        self,
        batch: InputBatch,
        num_scheduled_tokens: dict[str, int],
        so: Optional[SchedulerOutput] = None,
        non_block: bool = False,
    ) -> Any:
        """Prepare inputs, run the model, sample, and report: one forward pass over `batch`."""
        self._step_id += 1
        prev = self._prev
        if prev is not None and prev.tokens is None and batch.sampling.any_needs_token_values():
            # Penalties and multi-token bad words read the output tokens' values: wait for the previous step's.
            rows = batch.rows_of(list(num_scheduled_tokens))
            if batch.sampling.needs_token_values(rows[batch.pending_rows(rows, prev.step_id) >= 0]):
                prev.tokens_on_host()
        inputs = build_step_inputs(batch, num_scheduled_tokens, self.block_size, self._arange)
        fix = None
        if self.async_scheduling and (idx := self._prev_token_fix(batch, inputs)) is not None:
            assert prev is not None and prev.sampled is not None
            fix = self._fix_on_device(idx[0], idx[1], prev.sampled)
        if self.lora_manager is not None:  # this step's adapters in slots, and each token's slot, built once
            self.lora_manager.prepare_step(batch.lora_ids[inputs.rows], inputs.num_scheduled)
        logits_rows = self._logits_rows(batch, inputs, so)
        if self.lora_manager is not None:  # the adapters' slots of those rows (CPU only: see _logits_rows)
            self.lora_manager.keep_rows(logits_rows)
        hidden = self._run_model(inputs, so, logits_rows, fix)
        if self.pooler is not None:  # a pooling step: every request's whole prompt ran; pool, sample nothing
            batch.num_computed_tokens[inputs.rows] = inputs.seq_lens
            params = step_pooling_params(so, inputs.req_ids)
            return ModelRunnerOutput(
                req_ids=inputs.req_ids,
                req_id_to_index={r: i for i, r in enumerate(inputs.req_ids)},
                sampled_token_ids=[[] for _ in inputs.req_ids],
                pooler_output=list(pool_step(self.pooler, hidden, inputs.query_start_loc, params)),
            )
        prompt_lp = self._prompt_logprobs(batch, inputs, hidden)
        if non_block:
            return self._launch_sample(batch, inputs, hidden, so, prompt_lp)
        sampled = self._sample(batch, inputs, hidden, so)
        # Advance progress locally (less rejected drafts); the scheduler re-sends the authoritative value next step.
        batch.num_computed_tokens[inputs.rows] = inputs.seq_lens
        if sampled.num_rejected is not None:
            batch.num_computed_tokens[inputs.rows[sampled.index]] -= sampled.num_rejected
        if self.spec_decode is not None and so is not None:
            sampled.spec_token_ids = self.spec_decode.propose(batch, inputs, sampled.index, self.is_driver)
        return _build_output(inputs, sampled, prompt_lp, self._req_id_to_index(inputs.req_ids))

    def _req_id_to_index(self, req_ids: list[str]) -> dict[str, int]:
        """{request id: its index} for a step's requests; the last step's dict again when the list is the same."""
        c = self._req_index
        if c is not None and c[0] == req_ids:
            return c[1]
        index = dict(zip(req_ids, range(len(req_ids))))
        self._req_index = (list(req_ids), index)
        return index

    def _run_model(
        self,
        inputs: StepInputs,
        so: Optional[SchedulerOutput] = None,
        logits_rows: Optional[np.ndarray] = None,
        fix: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of every scheduled token (with token types where the model takes them); with
        `logits_rows` only those rows are computed past the last attention and the others are zeros. `fix`
        (async scheduling): (token indices, token ids) on the device, written over the input ids the host did not
        know yet (the previous step's sampled tokens)."""
        if self.cuda_graphs is not None and so is not None:  # a uniform step (decode, verify) that fits replays
            lora_slots = self.lora_manager.step_token_slots if self.lora_manager is not None else None
            host = self._staging.host if self._stage() is not None and self._staging is not None else None
            hidden = self.cuda_graphs.run(inputs, lora_slots, fix, host)
            if hidden is not None:
                return hidden
        input_ids, positions, md = inputs.to_device(self.device, self._stage())
        if fix is not None:
            input_ids.index_copy_(0, fix[0], fix[1])
        extra: dict[str, torch.Tensor] = {}
        if self.takes_token_types and (bounds := step_token_type_boundaries(so, inputs.req_ids)) is not None:
            types = build_token_type_ids(bounds, inputs.num_scheduled, inputs.positions)
            extra["token_type_ids"] = self._h2d(types, True)
        if logits_rows is not None:
            extra["logits_rows"] = self._h2d(logits_rows, True)
        with set_forward_context(md, self.backend):
            hidden = self.model(input_ids, positions, **extra)
        if logits_rows is None:
            return hidden
        full = hidden.new_zeros((inputs.num_tokens, hidden.shape[1]))
        return full.index_copy_(0, extra["logits_rows"], hidden)

    def _logits_rows(
        self, batch: InputBatch, inputs: StepInputs, so: Optional[SchedulerOutput]
    ) -> Optional[np.ndarray]:
        """The hidden-state rows this step reads (each sampling request's last token) when fewer than all and the
        model can skip the rest past its last attention (models/decoder.py); None: every row. Only for bf16/fp16
        models (float32 keeps the result every row count gives, for HF matching), and not with prompt logprobs,
        pooling, LoRA on CUDA (CPU LoRA layers take the kept rows' slots), speculation or the profiling pass
        (which reads every row or sizes for the worst case)."""
        if (
            so is None
            or inputs.num_tokens == inputs.num_reqs  # one row a request (decode): every row samples
            or self.dtype == torch.float32
            or self.pooler is not None
            or self.spec_decode is not None
            or (self.lora_manager is not None and self.device.type != "cpu")  # CPU LoRA layers take kept_slots
            or not getattr(self.model, "selects_rows", lambda: False)()
        ):
            return None
        if any(batch.params[r] is None or batch.params[r].prompt_logprobs is not None for r in inputs.rows.tolist()):
            return None
        s_idx = np.nonzero(inputs.sampling_mask(batch.num_tokens[inputs.rows]))[0]
        return None if len(s_idx) == inputs.num_tokens else inputs.query_start_loc[1:][s_idx] - 1

    def _sample(
        self, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor, so: Optional[SchedulerOutput] = None
    ) -> "_Sampled":
        """Sample one token for each row whose prompt is complete, and record it in the batch."""
        # Every request's known tokens as build_step_inputs read them (nothing changes them before sampling).
        known = inputs.req_num_tokens if inputs.req_num_tokens is not None else batch.num_tokens[inputs.rows]
        s_idx = np.flatnonzero(inputs.sampling_mask(known))
        if len(s_idx) == 0:
            return _Sampled(s_idx, np.zeros(0, np.int64), None)
        if so is not None and so.scheduled_spec_decode_tokens and self.spec_decode is not None:
            return self._sample_verified(batch, inputs, hidden, so, s_idx)
        s_rows = inputs.rows[s_idx]
        out = self._run_sampler(batch, inputs, hidden, so, s_idx)
        sampled = self._share_sampled(out, len(s_idx)).cpu().numpy()
        batch.record_sampled(s_rows, sampled)  # the scheduler records the same on its side
        logprobs = None
        if out is not None and out.logprobs_tensors is not None:
            logprobs = _scatter_rows(out.logprobs_tensors, s_idx, inputs.num_reqs)
        return _Sampled(s_idx, sampled, logprobs)

    def _run_sampler(
        self, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor, so: Optional[SchedulerOutput], s_idx
    ) -> Optional[SamplerOutput]:
        """Logits of the sampling rows and the sampler over them (rank 0 only under tensor parallelism)."""
        if len(s_idx) == inputs.num_tokens:  # one token a request, every one samples (decode): every row, in order
            rows = hidden if len(hidden) == inputs.num_tokens else hidden[: inputs.num_tokens]
        else:
            rows = hidden[self._h2d(inputs.query_start_loc[1:][s_idx] - 1, False)]
        head = self._sampling_head
        if head is None or len(rows) * self.vocab_size < sampler_module.BF16_ARGMAX_MIN_NUMEL:
            logits = self.model.compute_logits(rows)  # float32 (a small batch's copy is cheap: as ever)
        else:
            logits = linear(rows, head, None)  # bfloat16: the sampler converts only if a row needs float32
        if not self.is_driver:  # under tensor parallelism only rank 0 samples; the others take its tokens
            return None
        bitmask = None
        if so is not None and so.grammar_bitmask is not None:  # the ids list only when some row has a grammar
            bitmask = _grammar_bitmask_rows(so, [inputs.req_ids[i] for i in s_idx.tolist()])
        if bitmask is not None:
            bitmask = bitmask.to(self.device, non_blocking=True)
        return self.sampler(logits, batch.sampling_metadata(inputs.rows[s_idx]), bitmask)

    def _launch_sample(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        hidden: torch.Tensor,
        so: Optional[SchedulerOutput],
        prompt_lp: dict[str, Optional[LogprobsTensors]],
    ) -> AsyncModelRunnerOutput:
        """Async scheduling: sample on the device, queue the tokens' copy to pinned memory on the step's stream and
        return without waiting; the batch holds placeholders where the tokens go until get_output()."""
        assert self._sampled_ring is not None and self._staging is not None
        s_idx = np.nonzero(inputs.sampling_mask(batch.num_tokens[inputs.rows]))[0]
        batch.num_computed_tokens[inputs.rows] = inputs.seq_lens
        ring = self._sampled_ring
        if len(s_idx):
            out = self._run_sampler(batch, inputs, hidden, so, s_idx)
            assert out is not None
            sampled, lp, slot = out.sampled_token_ids, out.logprobs_tensors, ring.acquire()
        else:  # prefill chunks only: nothing to wait for but any prompt logprobs
            sampled, lp, slot = torch.zeros(0, dtype=torch.int64, device=self.device), None, -1
        try:
            return self._queue_copies(batch, inputs, s_idx, sampled, lp, slot, prompt_lp)
        except BaseException:
            if slot >= 0:  # a launch that failed holds no slot (the engine recovers with blocking steps)
                ring.release(slot)
            raise

    def _queue_copies(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        s_idx: np.ndarray,
        sampled: torch.Tensor,
        lp: Optional[LogprobsTensors],
        slot: int,
        prompt_lp: dict[str, Optional[LogprobsTensors]],
    ) -> AsyncModelRunnerOutput:
        """The sampled ids (and logprobs) on their way to pinned host memory; the batch's placeholders noted."""
        ring = self._sampled_ring
        assert ring is not None
        step = _LaunchedStep(
            runner=self,
            step_id=self._step_id,
            inputs=inputs,
            s_idx=s_idx,
            sampled=sampled,
            slot=slot,
        )
        if ring.cuda:  # queued on the step's stream, after the sampler's kernels (SampledRing: why no side stream)
            if slot >= 0:
                ring.head(slot, len(s_idx)).copy_(sampled, non_blocking=True)
            step.logprobs = None if lp is None else _to_host(lp)
            if prompt_lp:
                step.prompt_lp = {r: None if p is None else _to_host(p) for r, p in prompt_lp.items()}
            event = ring.events[slot] if slot >= 0 else torch.cuda.Event() if prompt_lp else None
            if event is not None:
                event.record(self._staging.stream if self._staging is not None else None)
                step.event = event
        else:
            if slot >= 0:
                ring.head(slot, len(s_idx)).copy_(sampled)
            step.logprobs, step.prompt_lp = lp, prompt_lp
        if slot < 0:
            return AsyncModelRunnerOutput(step.get_output)
        batch.note_sampled(inputs.rows[s_idx], step.step_id)
        self._prev = step
        return AsyncModelRunnerOutput(step.get_output)

    def _sample_verified(
        self, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor, so: SchedulerOutput, s_idx: np.ndarray
    ) -> "_Sampled":
        """A speculative step: every sampling row's 1 + k positions verified at once (spec_decode_step)."""
        assert self.spec_decode is not None
        req_ids = [inputs.req_ids[i] for i in s_idx.tolist()]
        s_rows = inputs.rows[s_idx]
        md = None
        if (
            self.is_driver
            and self.tp_size == 1
            and len(req_ids) <= SMALL_BATCH
            and self.spec_decode.draft is None
            and (so.grammar_bitmask is None or not so.structured_output_request_ids)
        ):
            md = batch.sampling_metadata(s_rows)
            if md.all_greedy and md.max_num_logprobs is None and not changes_argmax(md):
                return self._verified_greedy(batch, inputs, hidden, so, s_idx, s_rows, req_ids)
        drafts, num_draft = SpecDecodeStep.draft_table(so, req_ids)
        positions = SpecDecodeStep.logits_positions(inputs, s_idx, num_draft).reshape(-1)
        if len(positions) and bool((np.diff(positions) == 1).all()):  # consecutive (a uniform verify step): a view
            rows = hidden[int(positions[0]) : int(positions[0]) + len(positions)]
        else:
            rows = hidden[torch.from_numpy(positions).to(self.device)]
        logits = self.model.compute_logits(rows)
        tokens, lp = None, None
        if self.is_driver:
            bitmask = SpecDecodeStep.grammar_rows(so, req_ids, num_draft)  # one row per verified position
            if bitmask is not None:
                bitmask = bitmask.to(self.device, non_blocking=True)
            q, has_q = self.spec_decode.draft_probs(req_ids, drafts, num_draft)
            if md is None:
                md = batch.sampling_metadata(s_rows)
            tokens, lp = SpecDecodeStep.verify(logits, md, bitmask, drafts, num_draft, q, has_q)
            if self.tp_size == 1 and lp is None and len(req_ids) <= SMALL_BATCH:  # a few rows: lists from here on
                emitted = [[t for t in row if t >= 0] for row in tokens.tolist()]  # -1 pads only past the end
                return self._finish_verified(batch, inputs, s_idx, s_rows, req_ids, num_draft.tolist(), emitted)
        shape = (len(s_idx), drafts.shape[1] + 1)
        token_table = broadcast_from_driver(tokens, shape, torch.int64, self.device).cpu().numpy()
        num_emitted = (token_table >= 0).sum(axis=1)
        self.spec_decode.observe(req_ids, num_draft, num_emitted - 1)  # next steps' proposal lengths
        record_emitted(batch, s_rows, token_table, num_emitted)  # record_sampled's state, all columns at once
        counts = np.zeros(inputs.num_reqs, dtype=np.int64)
        counts[s_idx] = num_emitted
        logprobs = None
        if lp is not None:
            logprobs = LogprobsTensors(lp.logprob_token_ids.cpu(), lp.logprobs.cpu(), lp.selected_token_ranks.cpu())
        return _Sampled(
            s_idx,
            token_table[:, 0],
            logprobs,
            token_lists=[row[:n].tolist() for row, n in zip(token_table, num_emitted)],
            num_rejected=num_draft - (num_emitted - 1),
            logprobs_cu=(np.cumsum(counts) - counts).tolist(),
        )

    def _verified_greedy(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        hidden: torch.Tensor,
        so: SchedulerOutput,
        s_idx: np.ndarray,
        s_rows: np.ndarray,
        req_ids: list[str],
    ) -> "_Sampled":
        """`_sample_verified` for a few all-greedy rows that no logits processor, grammar or logprobs touch (n-gram,
        one rank): the scheduler's draft lists in, each row's emitted tokens out as lists, with no [S, K+1] draft,
        position or token tables and no tensors made on the host (batch 1 verifies every step this way; each
        numpy call or torch op avoided is microseconds of a step that the host, not the device, paces)."""
        assert self.spec_decode is not None
        table = so.scheduled_spec_decode_tokens
        drafts = [table.get(r) or [] for r in req_ids]
        counts = [len(d) for d in drafts]
        reps = max(counts) + 1
        s = len(drafts)
        if s == inputs.num_reqs and inputs.num_tokens == s * reps and min(counts) == reps - 1:
            rows = hidden[: s * reps]  # every request runs its last token and reps - 1 drafts: every row, in order
        else:  # each row's last 1 + n positions; padding repeats its last (as logits_positions)
            ends = inputs.query_start_loc.tolist()
            positions: list[int] = []
            for i, n in zip(s_idx.tolist(), counts):
                first = ends[i + 1] - 1 - n
                positions.extend(first + min(j, n) for j in range(reps))
            rows = hidden[self._h2d(np.array(positions, dtype=np.int64), True)]
        emitted = SpecDecodeStep.verify_greedy(self.model.compute_logits(rows), drafts, reps)
        return self._finish_verified(batch, inputs, s_idx, s_rows, req_ids, counts, emitted)

    def _finish_verified(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        s_idx: np.ndarray,
        s_rows: np.ndarray,
        req_ids: list[str],
        counts: list[int],
        emitted: list[list[int]],
    ) -> "_Sampled":
        """A few verified rows' bookkeeping from lists (one rank, no logprobs): each row ran counts[i] drafts and
        emitted `emitted[i]` (its accepted drafts and one more token). Proposal lengths observed, the batch
        recorded, the step's result: what the table path leaves, without its [S, K+1] tables."""
        assert self.spec_decode is not None
        num_emitted = [len(e) for e in emitted]
        self.spec_decode.observe(req_ids, counts, [n - 1 for n in num_emitted])  # next steps' proposal lengths
        record_emitted_lists(batch, s_rows.tolist(), emitted)
        per_req = [0] * inputs.num_reqs
        for i, n in zip(s_idx.tolist(), num_emitted):
            per_req[i] = n
        logprobs_cu, total = [], 0
        for n in per_req:
            logprobs_cu.append(total)
            total += n
        return _Sampled(
            s_idx,
            np.array([e[0] for e in emitted], dtype=np.int64),
            None,
            token_lists=emitted,
            num_rejected=np.array([c - n + 1 for c, n in zip(counts, num_emitted)], dtype=np.int64),
            logprobs_cu=logprobs_cu,
        )

    def _share_sampled(self, out: Optional[SamplerOutput], n: int) -> torch.Tensor:
        """The sampled token ids [n], identical on every tensor-parallel rank (rank 0's); free at TP=1."""
        if self.tp_size == 1:
            assert out is not None
            return out.sampled_token_ids
        return broadcast_from_driver(None if out is None else out.sampled_token_ids, (n,), torch.int64, self.device)

    def _prompt_logprobs(
        self, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor
    ) -> dict[str, Optional[LogprobsTensors]]:
        """Logprobs of each prompt token given its prefix, for requests that asked for them."""
        out: dict[str, Optional[LogprobsTensors]] = {}
        if not batch.num_prompt_logprob_reqs:  # no request asks for them (the usual step): nothing to look at
            return out
        for i, row in enumerate(inputs.rows.tolist()):
            params = batch.params[row]
            if params is None or params.prompt_logprobs is None:
                continue
            n_prompt = int(batch.num_prompt_tokens[row])
            start = int(inputs.num_computed[i])
            if start >= n_prompt - 1:
                continue
            # Positions p in this chunk with a prompt token at p + 1.
            end = min(start + int(inputs.num_scheduled[i]), n_prompt - 1)
            first = int(inputs.query_start_loc[i])
            tok_slice = torch.arange(first, first + (end - start), device=hidden.device)
            targets = self._h2d(batch.token_ids[row, start + 1 : end + 1].copy(), False)
            logits = self.model.compute_logits(hidden[tok_slice])
            out[inputs.req_ids[i]] = compute_prompt_logprobs(logits, targets, params.prompt_logprobs)
        return out


def _sampling_head(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> Optional[torch.nn.Module]:
    """The LM head whose bfloat16 output the runner hands the sampler as it is: on CPU, at TP=1, for bfloat16
    models whose compute_logits is CausalLM's (`lm_head_logits`: this head's linear, then a float32 copy). The
    sampler makes that copy itself when some row needs float32 (logprobs, processors, random draws); an all-greedy
    batch takes the argmax of the bfloat16 logits, which is the argmax of their exact float32 conversion
    (sampler.greedy_argmax), without the copy (~0.2 ms of a 32-row step on 2 Zen 4 cores). Used from
    sampler.BF16_ARGMAX_MIN_NUMEL logits on (smaller batches: compute_logits, as before). None: compute_logits,
    as on CUDA, under tensor parallelism and for models with their own (Gemma 2's soft cap)."""
    head = getattr(model, "lm_head", None)
    if (
        device.type != "cpu"
        or dtype != torch.bfloat16
        or type(model).compute_logits is not CausalLM.compute_logits
        or not isinstance(head, VocabParallelEmbedding)
        or head.tp_size != 1
    ):
        return None
    return head


def _to_host(lp: LogprobsTensors) -> LogprobsTensors:
    """Logprobs queued for the host (CUDA: into pinned memory, complete once the step's sampled-ids event is)."""
    return LogprobsTensors(
        *(t.to("cpu", non_blocking=True) for t in (lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks))
    )


@dataclass
class _LaunchedStep:
    """A step launched with non_block=True: its sampled tokens on the device and in a pinned ring slot."""

    runner: GPUModelRunner
    step_id: int
    inputs: StepInputs
    s_idx: np.ndarray  # int64 [S] positions (in the step's request order) that sampled
    sampled: Optional[torch.Tensor]  # int64 [S] on the device: the next step's input ids read it there
    slot: int  # the SampledRing slot its ids are copied into
    event: Optional[torch.cuda.Event] = None  # that copy's (CUDA): the slot's, recorded again on its next use
    logprobs: Optional[LogprobsTensors] = None  # host copies on CUDA
    prompt_lp: dict[str, Optional[LogprobsTensors]] = field(default_factory=dict)
    tokens: Optional[np.ndarray] = None  # int64 [S] once on the host
    output: Optional[ModelRunnerOutput] = None

    def tokens_on_host(self) -> np.ndarray:
        """Wait for the ids, and write them over their placeholders in the batch (once)."""
        if self.tokens is None:
            ring = self.runner._sampled_ring
            assert ring is not None
            if self.event is not None:
                self.event.synchronize()
            if self.slot < 0:  # sampled nothing
                self.tokens = np.zeros(0, dtype=np.int64)
                return self.tokens
            self.tokens = ring.host_views[self.slot][: len(self.s_idx)].copy()
            ring.release(self.slot)
            # Rows still waiting for these tokens (InputBatch.pending_idx: entry i of `sampled` per row).
            self.runner.input_batch.fill_pending(self.tokens, self.step_id)
        return self.tokens

    def get_output(self) -> ModelRunnerOutput:
        if self.output is None:
            tokens = self.tokens_on_host()
            logprobs = None
            if self.logprobs is not None:
                logprobs = _scatter_rows(self.logprobs, self.s_idx, self.inputs.num_reqs)
            self.output = _build_output(
                self.inputs,
                _Sampled(self.s_idx, tokens, logprobs),
                self.prompt_lp,
                self.runner._req_id_to_index(self.inputs.req_ids),
            )
            self.sampled = None  # the device tensor is no longer needed
            if self.runner._prev is self:
                self.runner._prev = None
        return self.output


@dataclass
class _Sampled:
    """This step's sampled tokens: batch indices that sampled, their token ids, their logprobs."""

    index: np.ndarray  # int64 [S] positions in the step's request order
    token_ids: np.ndarray  # int64 [S]
    logprobs: Optional[LogprobsTensors]  # rows aligned with the step's requests, or None
    # Speculative steps: every token each sampled row emitted, drafts rejected per sampled row, the first
    # logprobs row of each request (logprobs then hold one row per emitted token), next drafts per request.
    token_lists: Optional[list[list[int]]] = None
    num_rejected: Optional[np.ndarray] = None
    logprobs_cu: Optional[list[int]] = None
    spec_token_ids: Optional[list[list[int]]] = None


def _build_output(
    inputs: StepInputs,
    sampled: _Sampled,
    prompt_lp: dict[str, Optional[LogprobsTensors]],
    req_id_to_index: Optional[dict[str, int]] = None,
) -> ModelRunnerOutput:
    """The step's ModelRunnerOutput; `req_id_to_index` (the runner's, maybe the last step's same dict) or built."""
    n = inputs.num_reqs
    if sampled.token_lists is None and len(sampled.index) == n:  # every request sampled one token (decode)
        # index is the step's request order, ascending (np.nonzero of the sampling mask): 0..n-1.
        sampled_lists = [[tok] for tok in sampled.token_ids.tolist()]
    else:
        sampled_lists = _sampled_lists(sampled, n)
    return ModelRunnerOutput(
        req_ids=inputs.req_ids,
        req_id_to_index=dict(zip(inputs.req_ids, range(n))) if req_id_to_index is None else req_id_to_index,
        sampled_token_ids=sampled_lists,
        logprobs=sampled.logprobs,
        prompt_logprobs_dict=prompt_lp,
        spec_token_ids=sampled.spec_token_ids,
        logprobs_cu=sampled.logprobs_cu,
    )


def _sampled_lists(sampled: _Sampled, num_reqs: int) -> list[list[int]]:
    sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
    if sampled.token_lists is not None:
        for i, toks in zip(sampled.index.tolist(), sampled.token_lists):
            sampled_lists[i] = toks
    else:
        for i, tok in zip(sampled.index.tolist(), sampled.token_ids.tolist()):
            sampled_lists[i] = [tok]
    return sampled_lists


def _grammar_bitmask_rows(so: Optional[SchedulerOutput], sampled_req_ids: list[str]) -> Optional[torch.Tensor]:
    """The scheduler's grammar bitmask laid out in sampling order: int32 [S, W], all ones on unconstrained rows."""
    if so is None or so.grammar_bitmask is None or not so.structured_output_request_ids:
        return None
    src = torch.as_tensor(so.grammar_bitmask, dtype=torch.int32)
    rows = so.structured_output_request_ids
    dst_idx = [j for j, rid in enumerate(sampled_req_ids) if rid in rows]
    if not dst_idx:
        return None
    full = torch.full((len(sampled_req_ids), src.shape[1]), -1, dtype=torch.int32)
    full[dst_idx] = src[[rows[sampled_req_ids[j]] for j in dst_idx]]
    return full


def _scatter_rows(lp: LogprobsTensors, idx: np.ndarray, n: int) -> LogprobsTensors:
    """Place sampled rows' logprobs at their request positions (other rows zero)."""
    t = torch.from_numpy(idx)
    lp = LogprobsTensors(lp.logprob_token_ids.cpu(), lp.logprobs.cpu(), lp.selected_token_ranks.cpu())
    ids = lp.logprob_token_ids.new_zeros((n, lp.logprob_token_ids.shape[1]))
    vals = lp.logprobs.new_zeros((n, lp.logprobs.shape[1]))
    ranks = lp.selected_token_ranks.new_zeros((n,))
    ids[t] = lp.logprob_token_ids
    vals[t] = lp.logprobs
    ranks[t] = lp.selected_token_ranks
    return LogprobsTensors(ids, vals, ranks)
