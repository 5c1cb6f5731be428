"""Pooling: one step's hidden states -> one tensor per request (vLLM's pooler, batched).

The runner hands over the hidden states of every scheduled token ([T, hidden], requests laid
out by `query_start_loc`). Pooling is one batched op for the whole step: `index_select` of each
request's last (LAST) or first (CLS) token, a segment sum by `index_add_` for MEAN, the rows
as they are for ALL. A classifier head (the model's `classifier_head`, when it has one) runs on
the pooled rows for classify/score requests. Then, per request but still batched through masks:
Matryoshka truncation (`dimensions`), L2 normalisation (`normalize`), the classifier's activation
(softmax, or sigmoid for a single label). Results are float32 on the CPU, one tensor per request.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.config import ModelConfig
from vllm_lite.pooling_config import PoolerConfig
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.worker.step import SchedulerOutput

# Tasks whose requests go through the model's classifier head (when it has one).
_HEAD_TASKS = ("classify", "score", "token_classify")
# Tasks that return every token's row whatever the model's pooling type.
_TOKEN_TASKS = ("token_embed", "token_classify")
_DEFAULT_PARAMS = PoolingParams()


class Pooler:
    """Pools hidden states by the model's pooling type and applies each request's options."""

    def __init__(self, config: PoolerConfig, model: nn.Module) -> None:
        if config.pooling_type is None:
            raise ValueError("pooler_config.pooling_type must be resolved before the pooler is built.")
        self.config = config
        self.pooling_type = config.pooling_type
        # A model with a classification head (e.g. *ForSequenceClassification) exposes it as classifier_head.
        self.head: Optional[nn.Module] = getattr(model, "classifier_head", None)

    def __call__(
        self, hidden: torch.Tensor, query_start_loc: np.ndarray, params: Sequence[Optional[PoolingParams]]
    ) -> list[torch.Tensor]:
        """`hidden` [T, H]; request i owns rows query_start_loc[i]:query_start_loc[i+1]; one tensor per request
        (float32, on hidden's device): [W] per request, or [tokens, W] for ALL pooling."""
        qsl = torch.from_numpy(np.asarray(query_start_loc, dtype=np.int64)).to(hidden.device)
        lens = qsl[1:] - qsl[:-1]
        ps = [p or _DEFAULT_PARAMS for p in params]
        per_token = [self.pooling_type == "ALL" or p.task in _TOKEN_TASKS for p in ps]
        if all(per_token):
            return self._token_outputs(hidden, lens, ps)
        if not any(per_token):
            return self._pooled_outputs(self.pool(hidden, qsl, lens), ps)
        # token_* requests beside pooled ones: each group batched on its own rows.
        tok_idx = [i for i, t in enumerate(per_token) if t]
        seq_idx = [i for i, t in enumerate(per_token) if not t]
        seg = torch.repeat_interleave(torch.arange(len(ps), device=hidden.device), lens)
        keep = torch.tensor(per_token, device=hidden.device)[seg]
        tok_lens = lens.index_select(0, torch.tensor(tok_idx, device=hidden.device))
        tok = self._token_outputs(hidden[keep], tok_lens, [ps[i] for i in tok_idx])
        pooled = self.pool(hidden, qsl, lens).index_select(0, torch.tensor(seq_idx, device=hidden.device))
        seq = self._pooled_outputs(pooled, [ps[i] for i in seq_idx])
        by_index = dict(zip(tok_idx, tok)) | dict(zip(seq_idx, seq))
        return [by_index[i] for i in range(len(ps))]

    def _token_outputs(self, rows: torch.Tensor, lens: torch.Tensor, ps: Sequence[PoolingParams]) -> list[torch.Tensor]:
        """[tokens, W] per request: every token's row, with its request's options."""
        rows, dims = self._finish(rows.float(), ps, lens)
        per_req = torch.split(rows, lens.tolist())
        return [r[:, :d] for r, d in zip(per_req, dims.tolist())]

    def _pooled_outputs(self, pooled: torch.Tensor, ps: Sequence[PoolingParams]) -> list[torch.Tensor]:
        """[W] per request from its pooled row; classify beside embed requests go as two batched groups."""
        uses_head = [self._uses_head(p) for p in ps]
        if not any(uses_head) or all(uses_head):
            return self._sequence_outputs(pooled, ps)
        by_index: dict[int, torch.Tensor] = {}
        for group in (True, False):
            idx = [i for i, u in enumerate(uses_head) if u is group]
            sub = pooled.index_select(0, torch.tensor(idx, device=pooled.device))
            by_index.update(zip(idx, self._sequence_outputs(sub, [ps[i] for i in idx])))
        return [by_index[i] for i in range(len(ps))]

    def _uses_head(self, p: PoolingParams) -> bool:
        return self.head is not None and p.task in _HEAD_TASKS

    def _sequence_outputs(self, pooled: torch.Tensor, ps: Sequence[PoolingParams]) -> list[torch.Tensor]:
        rows, dims = self._finish(pooled, ps, torch.ones(len(ps), dtype=torch.int64, device=pooled.device))
        width = rows.shape[-1]
        if bool((dims == width).all()):
            return list(torch.unbind(rows, 0))
        return [rows[i, :d] for i, d in enumerate(dims.tolist())]

    def pool(self, hidden: torch.Tensor, qsl: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """[B, H] float32: each request's pooled hidden state."""
        if self.pooling_type == "LAST":
            return hidden.index_select(0, qsl[1:] - 1).float()
        if self.pooling_type == "CLS":
            return hidden.index_select(0, qsl[:-1]).float()
        # MEAN: a segment sum over each request's rows, in float32, divided by its length.
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        sums = torch.zeros((len(lens), hidden.shape[-1]), dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seg, hidden.float())
        return sums / lens.unsqueeze(1).to(torch.float32)

    def _finish(
        self, rows: torch.Tensor, ps: Sequence[PoolingParams], reps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head and activation, or truncation and normalisation, for each row by its request's params.

        `reps[i]`: how many rows request i owns. Batched through per-row masks (no per-request tensor op);
        returns the rows and each request's width (rows are zero past it).
        """
        device = rows.device
        uses_head = [self._uses_head(p) for p in ps]
        if any(uses_head):
            if not all(uses_head):
                raise ValueError("pooling: one step mixes classifier and embedding requests")
            out = self._classify(rows, ps, reps)
            return out, torch.full((len(ps),), out.shape[-1], dtype=torch.int64)
        h = rows.shape[-1]
        dims = torch.tensor([p.dimensions or h for p in ps], dtype=torch.int64)
        if bool((dims > h).any()):
            raise ValueError(f"pooling: dimensions larger than the model's hidden size {h}")
        if bool((dims < h).any()):  # Matryoshka: zero the dropped dimensions, so the norm is the kept part's
            row_dims = torch.repeat_interleave(dims.to(device), reps)
            rows = rows * (torch.arange(h, device=device).unsqueeze(0) < row_dims.unsqueeze(1))
        norm = torch.tensor([bool(p.normalize) for p in ps], dtype=torch.bool)
        if bool(norm.all()):
            rows = F.normalize(rows, p=2.0, dim=-1)
        elif bool(norm.any()):
            row_norm = torch.repeat_interleave(norm.to(device), reps)
            rows = torch.where(row_norm.unsqueeze(1), F.normalize(rows, p=2.0, dim=-1), rows)
        return rows, dims

    def _classify(self, rows: torch.Tensor, ps: Sequence[PoolingParams], reps: torch.Tensor) -> torch.Tensor:
        """The head's scores, through softmax (sigmoid for one label) where the request wants the activation."""
        assert self.head is not None
        dtype = next(self.head.parameters()).dtype
        logits = self.head(rows.to(dtype)).float()
        probs = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        act = torch.tensor([p.apply_activation is not False for p in ps], dtype=torch.bool)
        if bool(act.all()):
            return probs
        row_act = torch.repeat_interleave(act.to(rows.device), reps)
        return torch.where(row_act.unsqueeze(1), probs, logits)


def pool_step(
    pooler: Pooler, hidden: torch.Tensor, query_start_loc: np.ndarray, params: Sequence[Optional[PoolingParams]]
) -> list[torch.Tensor]:
    """The pooled tensors of one step, float32 on the CPU, one per request (one device-to-host copy when they
    share a shape)."""
    out = pooler(hidden, query_start_loc, params)
    if not out or out[0].device.type == "cpu":
        return out
    if all(t.shape == out[0].shape for t in out):
        return list(torch.stack(out).cpu().unbind(0))
    return [t.cpu() for t in out]


def step_pooling_params(so: Optional[SchedulerOutput], req_ids: Sequence[str]) -> list[Optional[PoolingParams]]:
    """Each scheduled request's PoolingParams, in step order. A pooling request runs in exactly one step, the one
    that brings it to the worker, so its params are in that step's new requests (None: the defaults)."""
    if so is None:
        return [None] * len(req_ids)
    by_id = {new.req_id: new.pooling_params for new in so.scheduled_new_reqs}
    return [by_id.get(rid) for rid in req_ids]


def make_pooler(model_config: ModelConfig, model: nn.Module) -> Optional[Pooler]:
    """The pooler of a pooling model; None for a generate model."""
    if model_config.runner_type != "pooling":
        return None
    if model_config.pooler_config is None:
        raise ValueError("a pooling model needs a resolved pooler_config (EngineArgs.create_engine_config sets it).")
    return Pooler(model_config.pooler_config, model)
