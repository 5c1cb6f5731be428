"""The draft model of `speculative_config={"model": DRAFT_DIR, ...}`: a smaller model of the same vocabulary that
runs in the target's worker, proposes k tokens per request per step, and keeps its own paged KV cache.

KV layout: one more [2, blocks, block_size, kv_heads, head_size] tensor per draft layer, with the same number of
blocks as the target's and addressed through the same block tables, so the scheduler's block accounting (one
table per request) covers both; the runner sizes the two together (bytes per block = target's + draft's). The
scheduler reserves k lookahead slots per request (`SpecDecodeScheduling.lookahead`) for the draft's passes.

Per step, after the target has sampled (and rejected drafts were rolled back):
- pass 1 (catch-up): the draft runs every scheduled request's tokens from the target's pre-step computed count up
  to its new computed count, plus the newly sampled token for rows that sampled. So the draft's KV holds exactly
  the tokens the target's does (prefill chunks included; accepted drafts rewritten, rejected ones dropped), and
  the logits at each sampling row's last token give its first draft.
- passes 2..k: one token per proposing request per pass (the previous draft), batched.
A draft token whose KV a later step needs is rewritten by that step's pass 1, so a rejected draft's KV is
overwritten, never read. Positions past a request's allocated blocks or max_model_len are never written: the
row then proposes fewer tokens.

A request backed off to proposal length 0 (`spec_decode/draft_length.py`) skips these passes; `_behind` keeps
where its draft KV ends, and its next pass (a probe, or after preemption) starts there. A prefix-cache block
filled meanwhile holds no draft KV for another request that hits it: that request's proposals are poorer there,
never wrong (verification decides what is emitted).

Greedy rows and seeded rows propose the draft's argmax (a point mass: the rejection sampler's coupling path keeps a
seeded row's one-draw-per-token stream, so replay after preemption stays exact). Other random rows sample from
the draft's softmax(logits / temperature) and keep that distribution q for the rejection sampler.

Tensor parallel: the draft is loaded sharded like the target and runs on every rank (its layers all-reduce);
rank 0 picks the draft tokens and broadcasts them each pass; only rank 0 keeps q (only it verifies).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vllm_lite.config import ModelConfig, VllmConfig
from vllm_lite.worker.attention.backend import AttentionBackend
from vllm_lite.worker.attention.layer import Attention
from vllm_lite.worker.forward_context import set_forward_context
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.model_loader import load_model
from vllm_lite.worker.models.cpu_prepack import maybe_prepack
from vllm_lite.worker.parallel_state import broadcast_from_driver
from vllm_lite.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

_EPS = 1e-5


def draft_model_config(target: ModelConfig, draft_dir: str) -> ModelConfig:
    """The draft's ModelConfig: the target's dtype and max_model_len, the draft's checkpoint; vocab must match."""
    hf = ModelConfig.read_hf_config(draft_dir)
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError(f"speculative_config.model: config.json in {draft_dir!r} names no architectures.")
    vocab = int(hf.get("vocab_size", 0))
    if vocab != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocab_size ({vocab}) differs from the target's "
            f"({target.vocab_size}); a draft model must share the target's vocabulary."
        )
    return dataclasses.replace(
        target, model=draft_dir, tokenizer=draft_dir, hf_config=hf, architecture=archs[0], served_model_name=None
    )


@dataclass
class DraftProposal:
    """One request's proposal: its draft tokens and, for a sampled proposal, the distributions they came from."""

    token_ids: list[int]
    probs: Optional[torch.Tensor]  # float32 [len(token_ids), V] on rank 0 for sampled proposals; None: point masses


def spans_to_inputs(
    batch: InputBatch,
    req_ids: list[str],
    rows: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    input_ids: np.ndarray,
    block_size: int,
) -> StepInputs:
    """StepInputs for running positions [starts[i], starts[i] + counts[i]) of each row (counts > 0), whose token
    ids are `input_ids` flattened in row order; the KV of those positions is written through the block table."""
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    total = int(cu[-1])
    req_of_tok = np.repeat(np.arange(len(rows)), counts)
    positions = starts[req_of_tok] + np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], counts)
    tok_rows = rows[req_of_tok]
    block_idx = batch.block_table[tok_rows, positions // block_size].astype(np.int64)
    seq_lens = starts + counts
    max_blocks = int(-(-seq_lens.max() // block_size))
    return StepInputs(
        req_ids=req_ids,
        rows=rows,
        num_scheduled=counts,
        query_start_loc=cu,
        num_computed=starts,
        seq_lens=seq_lens,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=block_idx * block_size + positions % block_size,
        block_table=batch.block_table[rows, :max_blocks],
        req_num_tokens=np.maximum(batch.num_tokens[rows], seq_lens),
    )


class DraftModel:
    """Loads the draft checkpoint, owns its KV cache, and proposes tokens for a step's sampling rows."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, backend: AttentionBackend) -> None:
        sc = vllm_config.speculative_config
        assert sc is not None and sc.method == "draft_model" and sc.model is not None
        assert sc.num_speculative_tokens is not None
        mc = vllm_config.model_config
        self.model_config = draft_model_config(mc, sc.model)
        self.device = device
        self.backend = backend
        self.dtype = mc.dtype
        self.k = sc.num_speculative_tokens
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.model = load_model(self.model_config, device)
        maybe_prepack(self.model, device, self.dtype, batch_hint=min(vllm_config.scheduler_config.max_num_seqs, 64))
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # Sampled proposals' q, by request, until verified or re-proposed (rank 0 only).
        self._proposals: dict[str, DraftProposal] = {}
        # Requests whose catch-up passes were skipped (proposal length 0): how many leading tokens the draft's KV
        # holds; their next pass starts there. Others start at the target's computed count.
        self._behind: dict[str, int] = {}

    # ------------------------------------------------------------------ KV cache
    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_size * elem for a in self.attn_layers)

    def allocate_kv_cache(
        self, num_gpu_blocks: int, num_cpu_blocks: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Bind one cache per draft layer (same block count as the target's); (device caches, host swap caches)."""
        caches, swaps = [], []
        for layer in self.attn_layers:
            shape = (2, num_gpu_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            caches.append(layer.kv_cache)
            if num_cpu_blocks > 0:
                swaps.append(
                    torch.zeros(
                        (2, num_cpu_blocks, *shape[2:]),
                        dtype=self.dtype,
                        device="cpu",
                        pin_memory=self.device.type == "cuda",
                    )
                )
        return caches, swaps

    # ------------------------------------------------------------------ proposals
    def forget(self, req_ids: set[str] | list[str]) -> None:
        """Drop what is kept for finished requests. (A request re-added after preemption keeps its `_behind`:
        catching up from there is right whether its KV was recomputed or swapped back in.)"""
        for r in req_ids:
            self._proposals.pop(r, None)
            self._behind.pop(r, None)

    def _drop_proposals(self, req_ids: list[str]) -> None:
        """The rows just verified (or skipped): their stored proposals are spent."""
        for r in req_ids:
            self._proposals.pop(r, None)

    def draft_probs(
        self, req_ids: list[str], drafts: np.ndarray, num_draft: np.ndarray
    ) -> Optional[tuple[torch.Tensor, np.ndarray]]:
        """(q, has_q) for the rows' scheduled drafts: q float32 [S, K, V] and which rows have one (bool numpy [S],
        known on the host, so the verification reads nothing back to split the rows), or None when no row has a
        sampled proposal.

        Rows without one (greedy, seeded, or drafts that are not the stored proposal's prefix) get all-zero rows,
        which the caller reads as point masses."""
        k = drafts.shape[1]
        hits = []
        for i, rid in enumerate(req_ids):
            p = self._proposals.get(rid)
            n = int(num_draft[i])
            if p is None or p.probs is None or n == 0:
                continue
            if p.token_ids[:n] != drafts[i, :n].tolist():
                logger.warning("request %s: scheduled drafts differ from its proposal; verified as point masses", rid)
                continue
            hits.append((i, n, p.probs))
        if not hits or k == 0:
            return None
        vocab = hits[0][2].shape[1]
        q = torch.zeros((len(req_ids), k, vocab), dtype=torch.float32, device=hits[0][2].device)
        has_q = np.zeros(len(req_ids), dtype=bool)
        for i, n, probs in hits:  # one copy per request with a sampled proposal (softmax rows: never all zero)
            q[i, :n] = probs[:n]
            has_q[i] = True
        return q, has_q

    @torch.inference_mode()
    def propose(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        s_idx: np.ndarray,
        is_driver: bool,
        lengths: Optional[np.ndarray] = None,
    ) -> list[list[int]]:
        """Catch the draft's KV up with this step and propose for the rows that sampled (aligned with
        inputs.req_ids; [] for the others). Called after the step's tokens were recorded and rolled back.
        `lengths` (int [len(s_idx)], optional) caps each sampling row's proposal: fewer one-token passes; a row
        with length 0 skips even its catch-up pass (a backed-off request decodes at plain cost) and catches up over
        every token it missed at its next proposal."""
        out: list[list[int]] = [[] for _ in range(inputs.num_reqs)]
        rows = inputs.rows
        sampled = np.zeros(inputs.num_reqs, dtype=bool)
        sampled[s_idx] = True
        capacity = batch.num_blocks[rows] * self.block_size
        starts = inputs.num_computed.astype(np.int64)
        if self._behind:  # the draft's KV of these requests ends earlier than the target's
            held = np.fromiter((self._behind.get(r, -1) for r in inputs.req_ids), dtype=np.int64, count=len(rows))
            starts = np.where(held >= 0, np.minimum(held, starts), starts)
        ends = np.where(sampled, batch.num_tokens[rows], batch.num_computed_tokens[rows])
        ends = np.minimum(ends, capacity)
        counts = np.maximum(ends - starts, 0)
        # Drafts per sampling row: room in its blocks and under max_model_len, and its new token's KV written.
        num_tokens = batch.num_tokens[rows]
        budget = np.minimum(np.minimum(capacity - num_tokens + 1, self.max_model_len - num_tokens), self.k)
        if lengths is not None:
            cap = np.full(inputs.num_reqs, self.k, dtype=np.int64)
            cap[s_idx] = lengths
            budget = np.minimum(budget, cap)
            skip = np.nonzero(sampled & (cap == 0))[0]
            counts[skip] = 0
            for i in skip.tolist():  # backed-off rows: remember where their draft KV ends
                self._behind[inputs.req_ids[i]] = int(starts[i])
        budget = np.where(sampled & (ends == num_tokens) & (counts > 0), np.maximum(budget, 0), 0)
        run = np.nonzero(counts)[0]
        if self._behind:
            for i in run.tolist():  # caught up by this pass
                self._behind.pop(inputs.req_ids[i], None)
        if len(run) == 0:
            self._drop_proposals([inputs.req_ids[i] for i in s_idx.tolist()])
            return out
        tok_rows = np.repeat(rows[run], counts[run])
        tok_pos = starts[run][np.repeat(np.arange(len(run)), counts[run])] + (
            np.arange(int(counts[run].sum())) - np.repeat(np.cumsum(counts[run]) - counts[run], counts[run])
        )
        first = spans_to_inputs(
            batch,
            [inputs.req_ids[i] for i in run.tolist()],
            rows[run],
            starts[run],
            counts[run],
            batch.token_ids[tok_rows, tok_pos],
            self.block_size,
        )
        hidden = self._forward(first)
        prop = np.nonzero(budget[run] > 0)[0]  # indices into run
        self._drop_proposals([inputs.req_ids[i] for i in s_idx.tolist()])
        if len(prop) == 0:
            return out
        last = torch.from_numpy(first.query_start_loc[1:][prop] - 1).to(self.device)
        p_idx = run[prop]  # step indices of the proposing rows
        p_rows = rows[p_idx]
        temps = batch.sampling.temperature[p_rows]
        sample = (temps >= _EPS) & np.array([int(r) not in batch.sampling.generators for r in p_rows], dtype=bool)
        tokens, probs = self._pick(self.model.compute_logits(hidden[last]), temps, sample, is_driver)
        keep_q = probs is not None  # rank 0, some row samples
        drafts, q = [tokens], [probs]
        p_budget = budget[p_idx]
        for j in range(1, int(p_budget.max())):  # pass j + 1: rows that still have room, one token each
            alive = np.nonzero(p_budget > j)[0]
            pos = num_tokens[p_idx[alive]] + j - 1
            step = spans_to_inputs(
                batch,
                [inputs.req_ids[i] for i in p_idx[alive].tolist()],
                p_rows[alive],
                pos,
                np.ones(len(alive), dtype=np.int64),
                drafts[-1][alive],
                self.block_size,
            )
            logits = self.model.compute_logits(self._forward(step))
            t_new, p_new = self._pick(logits, temps[alive], sample[alive], is_driver)
            full_t = np.full(len(p_idx), -1, dtype=np.int64)
            full_t[alive] = t_new
            drafts.append(full_t)
            if keep_q:
                assert probs is not None
                full_p = torch.zeros_like(probs)
                if p_new is not None:
                    full_p[torch.from_numpy(alive).to(full_p.device)] = p_new
                q.append(full_p)
        table = np.stack(drafts, axis=1)  # [P, max budget]
        stacked = torch.stack(q, dim=1) if keep_q else None  # type: ignore[arg-type]
        for j, i in enumerate(p_idx.tolist()):
            n = int(p_budget[j])
            toks = table[j, :n].tolist()
            out[i] = toks
            if stacked is not None and bool(sample[j]):
                self._proposals[inputs.req_ids[i]] = DraftProposal(toks, stacked[j, :n])
        return out

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        input_ids, positions, md = inputs.to_device(self.device)
        with set_forward_context(md, self.backend):
            return self.model(input_ids, positions)

    def _pick(
        self, logits: torch.Tensor, temps: np.ndarray, sample: np.ndarray, is_driver: bool
    ) -> tuple[np.ndarray, Optional[torch.Tensor]]:
        """Draft tokens int64 [R] (identical on every rank) and, on rank 0 when some row samples, q float32 [R, V]
        (softmax(logits / temperature) on sampling rows; unused elsewhere)."""
        tokens: Optional[torch.Tensor] = None
        probs: Optional[torch.Tensor] = None
        if is_driver:
            logits = logits.float()
            tokens = logits.argmax(dim=-1)
            if sample.any():
                t = torch.from_numpy(np.where(sample, temps, 1.0).astype(np.float32)).to(logits.device)
                probs = torch.softmax(logits / t.unsqueeze(1), dim=-1)
                noise = torch.rand_like(probs).log_().neg_()  # Exp(1); a 0 draw gives weight 0
                raced = (probs / noise).argmax(dim=-1)  # a draw from probs (exponential race)
                tokens = torch.where(torch.from_numpy(sample).to(logits.device), raced, tokens)
        shared = broadcast_from_driver(tokens, (logits.shape[0],), torch.int64, self.device)
        return shared.cpu().numpy(), probs
