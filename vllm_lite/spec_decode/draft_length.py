"""Adaptive draft length: how many tokens to propose for each request next step, from how its drafts fared.

Why: a draft position costs proposal work (a draft model's forward pass per position) and verification rows,
and pays only when accepted. A request whose drafts keep failing (a weak draft model, text that lookup cannot
predict) backs off to fewer proposed tokens; one whose drafts are accepted whole grows back to
`num_speculative_tokens`. The rule, per verified draft of n tokens with a accepted:

- a == n (all accepted): next length min(k, current + 2);
- a == 0 (all rejected): next length max(1, current // 2);
- otherwise unchanged.

Exactness does not depend on it: the rejection sampler keeps the target distribution (and greedy equality) for
any proposal, of any length. The lengths are computed from the verified token table, which every tensor-parallel
rank holds, so every rank runs the same draft passes.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


class AdaptiveDraftLength:
    """Per-request proposal lengths in [1, num_speculative_tokens], keyed by request id (unknown: the maximum)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens!r}.")
        self.k = num_speculative_tokens
        self._length: dict[str, int] = {}

    def lengths(self, req_ids: Sequence[str]) -> np.ndarray:
        """int64 [len(req_ids)]: how many tokens to propose for each request."""
        get = self._length.get
        return np.fromiter((get(r, self.k) for r in req_ids), dtype=np.int64, count=len(req_ids))

    def observe(self, req_ids: Sequence[str], num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """One verified step: request i ran num_draft[i] drafts and the first num_accepted[i] held."""
        drafts = np.asarray(num_draft, dtype=np.int64).reshape(-1)
        accepted = np.asarray(num_accepted, dtype=np.int64).reshape(-1)
        if not len(req_ids) == len(drafts) == len(accepted):
            raise ValueError(f"need one count per request, got {len(req_ids)}, {len(drafts)} and {len(accepted)}.")
        if len(drafts) and ((accepted < 0) | (accepted > drafts)).any():
            raise ValueError(f"need 0 <= num_accepted <= num_draft, got {accepted!r} and {drafts!r}.")
        current = self.lengths(req_ids)
        grown = np.minimum(self.k, current + 2)
        shrunk = np.maximum(1, current // 2)
        new = np.where(accepted == drafts, grown, np.where(accepted == 0, shrunk, current))
        changed = np.nonzero((drafts > 0) & (new != current))[0]
        for i in changed.tolist():  # only requests whose length moved
            self._length[req_ids[i]] = int(new[i])

    def forget(self, req_ids: Iterable[str]) -> None:
        """Finished requests: drop their lengths."""
        for r in req_ids:
            self._length.pop(r, None)
