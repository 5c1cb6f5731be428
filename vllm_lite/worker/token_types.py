"""Per-token token types of one step, rebuilt from each request's compressed form (where type 1 begins).

Only models whose forward takes `token_type_ids` (BERT) get them, and only in a step where some request
carries a boundary; every other model and step runs exactly as before. The per-token tensor comes from one
vectorised comparison over the step's packed positions, never a loop over requests' tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Optional

import numpy as np
from torch import nn

from vllm_lite.worker.step import SchedulerOutput

_NO_TYPE_1 = np.iinfo(np.int64).max  # a boundary no position reaches: every token type 0


def takes_token_type_ids(model: nn.Module) -> bool:
    """Whether the model's forward accepts `token_type_ids` (decoders do not, and never see it)."""
    return "token_type_ids" in inspect.signature(model.forward).parameters


def step_token_type_boundaries(so: Optional[SchedulerOutput], req_ids: Sequence[str]) -> Optional[np.ndarray]:
    """int64 [B]: where token type 1 begins for each scheduled request, in step order; None when none carries
    one. A pooling request runs in the one step that brings it to the worker, so its boundary is in that
    step's new requests."""
    if so is None:
        return None
    by_id = {
        new.req_id: new.compressed_token_type_ids
        for new in so.scheduled_new_reqs
        if new.compressed_token_type_ids is not None
    }
    if not by_id:
        return None
    return np.fromiter((by_id.get(r, _NO_TYPE_1) for r in req_ids), dtype=np.int64, count=len(req_ids))


def build_token_type_ids(boundaries: np.ndarray, num_scheduled: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """int64 [T]: 1 where a token's position is at or past its request's boundary, else 0.

    boundaries / num_scheduled: int64 [B] per request in step order; positions: int64 [T], the packed tokens'
    positions within their requests (request i owns the next num_scheduled[i] of them)."""
    return (positions >= np.repeat(boundaries, num_scheduled)).astype(np.int64)
