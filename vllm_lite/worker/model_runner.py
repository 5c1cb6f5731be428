"""GPUModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It keeps the persistent `InputBatch`, builds the flattened inputs with numpy
(token ids, positions, slot mapping, block tables, query start offsets),
copies them to the device once, runs the model under the step's forward
context, and samples only the rows whose prompt is complete.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from vllm_lite.config import VllmConfig
from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata
from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.model_loader import load_model
from vllm_lite.worker.models.cpu_prepack import maybe_prepack
from vllm_lite.worker.parallel_state import broadcast_from_driver, get_tp_rank, get_tp_size
from vllm_lite.worker.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from vllm_lite.worker.sampling_state import SamplingState
from vllm_lite.worker.step import LogprobsTensors, ModelRunnerOutput, SchedulerOutput

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
        self.load_time_s = time.perf_counter() - t0
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.vocab_size = mc.vocab_size
        self.backend = _get_backend(device)
        self.sampler = Sampler()
        self.tp_size, self.is_driver = get_tp_size(), get_tp_rank() == 0
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_blocks_per_req)
        self.sampling_state = SamplingState(self.max_num_reqs, self.vocab_size, self.max_model_len, device)
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] = []
        # Reused host buffers for step inputs (no per-step allocation of large arrays).
        self._arange = np.arange(max(self.max_num_tokens, self.max_model_len) + 1, dtype=np.int64)

    # ------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_size * elem for a in self.attn_layers)

    def initialize_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate one [2, blocks, block_size, kv_heads, head_size] tensor per layer and bind it."""
        self.kv_caches = []
        for layer in self.attn_layers:
            shape = (2, num_gpu_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        self.swap_caches = [
            torch.zeros((2, num_cpu_blocks, self.block_size, a.num_kv_heads, a.head_size), dtype=self.dtype,
                        device="cpu", pin_memory=self.device.type == "cuda")
            for a in self.attn_layers
        ] if num_cpu_blocks > 0 else []

    # ------------------------------------------------------------------ state diff
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            row = batch.req_id_to_row.get(req_id)
            if row is None:
                continue
            moved = batch.remove_request(req_id)
            self.sampling_state.remove_request(row)
            if moved is not None:
                self.sampling_state.move_row(moved[0], moved[1])
        for new in so.scheduled_new_reqs:
            if new.req_id in batch.req_id_to_row:  # re-sent after preemption without a finish notice
                row = batch.req_id_to_row[new.req_id]
                moved = batch.remove_request(new.req_id)
                self.sampling_state.remove_request(row)
                if moved is not None:
                    self.sampling_state.move_row(moved[0], moved[1])
            row = batch.add_request(
                new.req_id, new.prompt_token_ids, new.output_token_ids, new.sampling_params,
                new.block_ids, new.num_computed_tokens,
            )
            self.sampling_state.add_request(
                row, new.sampling_params, new.prompt_token_ids, new.output_token_ids,
                new.eos_token_id,
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            row = batch.req_id_to_row[req_id]
            batch.append_block_ids(row, new_blocks)
            batch.num_computed_tokens[row] = num_computed

    def _move_blocks(self, so: SchedulerOutput) -> None:
        if so.blocks_to_swap_out:
            self.backend.swap_blocks(self.kv_caches, self.swap_caches, torch.tensor(so.blocks_to_swap_out, dtype=torch.int64))
        if so.blocks_to_swap_in:
            self.backend.swap_blocks(self.swap_caches, self.kv_caches, torch.tensor(so.blocks_to_swap_in, dtype=torch.int64))
        if so.blocks_to_copy:
            self.backend.copy_blocks(self.kv_caches, torch.tensor(so.blocks_to_copy, dtype=torch.int64, device=self.device))

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        self._move_blocks(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        batch = self.input_batch

        # Scheduled rows in batch-row order.
        req_ids = [r for r in so.num_scheduled_tokens]
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        req_ids = [req_ids[i] for i in order]
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_reqs = len(req_ids)
        total = int(num_sched.sum())

        computed = batch.num_computed_tokens[rows]
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        # Position of every token: its request's computed count + offset within this step.
        req_of_tok = np.repeat(np.arange(num_reqs), num_sched)
        offs = self._arange[:total] - np.repeat(cu[:-1], num_sched)
        positions = computed[req_of_tok] + offs
        tok_rows = rows[req_of_tok]
        input_ids = batch.token_ids[tok_rows, positions]
        block_idx = batch.block_table[tok_rows, positions // self.block_size].astype(np.int64)
        slot_mapping = block_idx * self.block_size + positions % self.block_size
        seq_lens = computed + num_sched
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        block_table = batch.block_table[rows, :max_blocks]

        dev = self.device
        qsl_cpu = torch.from_numpy(cu.astype(np.int32))
        seq_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        md = AttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=seq_cpu.to(dev, non_blocking=True),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        input_ids_t = torch.from_numpy(input_ids).to(dev, non_blocking=True)
        positions_t = torch.from_numpy(positions).to(dev, non_blocking=True)
        with set_forward_context(md, self.backend):
            hidden = self.model(input_ids_t, positions_t)

        # Rows whose known tokens are all computed after this step sample a new token.
        num_known = batch.num_tokens[rows]
        sampling = seq_lens >= num_known
        prompt_lp = self._prompt_logprobs(req_ids, rows, computed, num_sched, cu, hidden)

        sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: Optional[LogprobsTensors] = None
        if sampling.any():
            s_idx = np.nonzero(sampling)[0]
            s_rows = rows[s_idx]
            logits_idx = torch.from_numpy(cu[1:][s_idx] - 1).to(dev)
            logits = self.model.compute_logits(hidden[logits_idx])
            out = None
            if self.is_driver:  # under tensor parallelism only rank 0 samples; the others take its tokens
                out = self.sampler(logits, self.sampling_state.make_metadata(s_rows))
            sampled = self._share_sampled(out, len(s_idx)).cpu().numpy()
            # Record the new tokens in the persistent batch (the scheduler does the same on its side).
            pos = batch.num_tokens[s_rows]
            ok = pos < self.max_model_len
            batch.token_ids[s_rows[ok], pos[ok]] = sampled[ok]
            batch.num_tokens[s_rows[ok]] += 1
            self.sampling_state.append_token_ids(s_rows, sampled)
            for i, tok in zip(s_idx.tolist(), sampled.tolist()):
                sampled_lists[i] = [tok]
            if out is not None and out.logprobs_tensors is not None:
                logprobs = _scatter_rows(out.logprobs_tensors, s_idx, num_reqs)
        # Advance progress locally; the scheduler re-sends the authoritative value next step.
        batch.num_computed_tokens[rows] = seq_lens
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled_lists,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_lp,
        )

    def _share_sampled(self, out: Optional[SamplerOutput], n: int) -> torch.Tensor:
        """The sampled token ids [n], identical on every tensor-parallel rank (rank 0's); free at TP=1."""
        if self.tp_size == 1:
            assert out is not None
            return out.sampled_token_ids
        return broadcast_from_driver(None if out is None else out.sampled_token_ids, (n,), torch.int64, self.device)

    def _prompt_logprobs(
        self, req_ids: list[str], rows: np.ndarray, computed: np.ndarray, num_sched: np.ndarray,
        cu: np.ndarray, hidden: torch.Tensor,
    ) -> dict[str, Optional[LogprobsTensors]]:
        """Logprobs of each prompt token given its prefix, for requests that asked for them."""
        out: dict[str, Optional[LogprobsTensors]] = {}
        batch = self.input_batch
        for i, row in enumerate(rows.tolist()):
            params = batch.params[row]
            if params is None or params.prompt_logprobs is None:
                continue
            n_prompt = int(batch.num_prompt_tokens[row])
            start = int(computed[i])
            if start >= n_prompt - 1:
                continue
            # Positions p in this chunk with a prompt token at p + 1.
            end = min(start + int(num_sched[i]), n_prompt - 1)
            tok_slice = torch.arange(int(cu[i]), int(cu[i]) + (end - start), device=hidden.device)
            targets = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1].copy()).to(hidden.device)
            logits = self.model.compute_logits(hidden[tok_slice])
            out[req_ids[i]] = compute_prompt_logprobs(logits, targets, params.prompt_logprobs)
        return out


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
