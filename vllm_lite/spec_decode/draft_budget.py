"""Per-step draft budget for n-gram proposals: speculation must not cost batch throughput.

Why: a verify step costs by its rows. At batch 1 a request's k drafts ride nearly free (1 + k rows cost about
what one does in the small-m linear kernels), but a batch of B requests with k drafts each runs B * (1 + k) rows,
past the row count where the linears change cost (csrc/bf16_small_m.cpp takes <= 12 rows; oneDNN above), and a
batch runs until its least predictable request finishes, so the others' accepted drafts buy it little (measured
on Zen 4, bundled model, 4 random prompts: 14-24 rows at 2.1 ms a step vs 4 rows at 1.25 ms, 348 vs 384 steps,
0.79-0.96x the throughput without speculation).

The rule, applied to the proposals of each step (batch 1 is left alone):

- `disable_by_batch_size` (vLLM's speculative_config field): no drafts at all once that many requests run.
- At B > 1 sampling requests the step's drafts are capped at `max_rows - B` (`max_rows` = SMALL_M_ROWS, the
  small-m kernel's row limit), handed out to the requests whose drafts have held best so far (an exponential
  average of accepted / proposed per request, ACCEPT_EMA_WEIGHT per verified step), each up to its proposal.
- At B > 1 a request whose average has fallen below MIN_ACCEPTANCE proposes nothing; every step it sits out moves
  its average RECOVERY of the way back to the prior, so it retries after a while (from 0: ~8 steps).

Status (measured, benchmarks/PROFILE.md): the row budget is OPT-IN (`SpecDecodeStep.use_draft_budget`,
benchmarks/spec_decode.py --budget-rows): on Zen 4 it did not lift random-workload batch throughput (bf16, 10
rounds: 0.85x with it, 0.84x without) and cost the repetitive one (0.91x vs 0.99x; f32 1.63x vs 1.90x).
`disable_by_batch_size` is always honoured when set (bf16 random batch 0.96x with it set to 2).

Exactness does not depend on it: any proposal, of any length, verifies to the same greedy tokens and the same
target distribution. Only the step's token table (which every tensor-parallel rank holds) feeds it, so every
rank trims alike. Cost: one Python pass over the step's sampling requests (a dict look-up each).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

SMALL_M_ROWS = 12  # rows the bf16 small-m linear kernel takes (the engine's rule); a verify step stays within it
PRIOR_ACCEPTANCE = 0.5  # a new request's average (and where a sidelined one drifts back to)
ACCEPT_EMA_WEIGHT = 0.3  # weight of the newest verified step in the average
MIN_ACCEPTANCE = 0.25  # below this (at B > 1) a request proposes nothing until its average recovers
RECOVERY = 0.05  # per sidelined step: the average moves this share of the way back to the prior


class DraftBudget:
    """Trims a step's proposal lengths; keeps a per-request acceptance average, keyed by request id."""

    def __init__(self, max_rows: Optional[int] = SMALL_M_ROWS, disable_by_batch_size: Optional[int] = None) -> None:
        """max_rows None: no row cap and no acceptance rule, only disable_by_batch_size."""
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows!r}.")
        if disable_by_batch_size is not None and disable_by_batch_size < 2:
            raise ValueError(f"disable_by_batch_size must be >= 2, got {disable_by_batch_size!r}.")
        self.max_rows = max_rows
        self.disable_by_batch_size = disable_by_batch_size
        self._ema: dict[str, float] = {}

    def acceptance(self, req_id: str) -> float:
        return self._ema.get(req_id, PRIOR_ACCEPTANCE)

    def trim(self, req_ids: Sequence[str], counts: np.ndarray, num_running: Optional[int] = None) -> np.ndarray:
        """New proposal lengths (int64, <= counts) for the step's sampling requests `req_ids` with proposals of
        `counts` tokens; `num_running` (default len(req_ids)) is what disable_by_batch_size compares against."""
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        b = len(req_ids)
        if b != len(counts):
            raise ValueError(f"need one count per request, got {b} and {len(counts)}.")
        running = b if num_running is None else num_running
        if self.disable_by_batch_size is not None and running >= self.disable_by_batch_size:
            return np.zeros_like(counts)
        if b <= 1 or self.max_rows is None:
            return counts
        budget = self.max_rows - b
        if budget <= 0:
            return np.zeros_like(counts)
        ema = self._ema
        scores = np.empty(b)
        for i, r in enumerate(req_ids):  # one dict look-up per request; sidelined ones drift back to the prior
            a = ema.get(r, PRIOR_ACCEPTANCE)
            if a < MIN_ACCEPTANCE:
                ema[r] = a + RECOVERY * (PRIOR_ACCEPTANCE - a)
                a = -1.0
            scores[i] = a
        out = np.where(scores >= 0, counts, 0)
        if int(out.sum()) <= budget:
            return out
        order = np.argsort(-scores, kind="stable")  # best average first, ties in step order
        cum = np.cumsum(out[order])
        kept = np.clip(budget - (cum - out[order]), 0, out[order])
        out[order] = kept
        return out

    def observe(self, req_ids: Sequence[str], num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """One verified step: request i ran num_draft[i] drafts and the first num_accepted[i] held."""
        drafts = np.asarray(num_draft, dtype=np.int64).reshape(-1)
        accepted = np.asarray(num_accepted, dtype=np.int64).reshape(-1)
        if not len(req_ids) == len(drafts) == len(accepted):
            raise ValueError(f"need one count per request, got {len(req_ids)}, {len(drafts)} and {len(accepted)}.")
        w = ACCEPT_EMA_WEIGHT
        for i in np.nonzero(drafts > 0)[0].tolist():
            r = req_ids[i]
            self._ema[r] = (1 - w) * self._ema.get(r, PRIOR_ACCEPTANCE) + w * float(accepted[i]) / float(drafts[i])

    def forget(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self._ema.pop(r, None)
