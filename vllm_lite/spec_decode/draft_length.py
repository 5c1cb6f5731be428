"""Adaptive draft length: how many tokens to propose for each request next step, from how its drafts fared.

Why: a draft position costs proposal work (a draft model's forward pass per position) and verification rows,
and pays only when accepted. A request whose drafts keep failing (a weak draft model, text it cannot predict)
backs off to fewer proposed tokens, down to none: it then decodes as plain steps and probes with one token after
`PROBE_INTERVAL` of its steps, an interval that doubles (up to `MAX_PROBE_INTERVAL`) with each failed probe and
resets when a draft token is accepted; one whose drafts are accepted whole grows back to `num_speculative_tokens`.
The rule, per verified draft of n tokens with a accepted:

- a == n (all accepted): next length min(k, current + 2);
- a == 0 (all rejected): next length current // 2 (from 1: none, until the next probe);
- otherwise unchanged.

Exactness does not depend on it: the rejection sampler keeps the target distribution (and greedy equality) for
any proposal, of any length. The lengths are computed from the verified token table and the step's requests,
which every tensor-parallel rank holds, so every rank runs the same draft passes.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

PROBE_INTERVAL = 8  # steps a backed-off request decodes without drafts before it proposes one token again
MAX_PROBE_INTERVAL = 64  # the interval doubles with each failed probe, up to this


class AdaptiveDraftLength:
    """Per-request proposal lengths in [0, num_speculative_tokens], keyed by request id (unknown: the maximum)."""

    def __init__(self, num_speculative_tokens: int, probe_interval: int = PROBE_INTERVAL) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens!r}.")
        if probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {probe_interval!r}.")
        self.k = num_speculative_tokens
        self.probe_interval = probe_interval
        self._length: dict[str, int] = {}
        self._idle: dict[str, int] = {}  # backed-off requests: steps decoded since their last probe
        self._interval: dict[str, int] = {}  # requests whose probes failed: their current probe interval
        self._probing: set[str] = set()  # requests proposing one probe token this step

    def lengths(self, req_ids: Sequence[str]) -> np.ndarray:
        """int64 [len(req_ids)]: how many tokens to propose for each request (0: none)."""
        get = self._length.get
        return np.fromiter((get(r, self.k) for r in req_ids), dtype=np.int64, count=len(req_ids))

    def for_step(self, req_ids: Sequence[str]) -> np.ndarray:
        """`lengths` for requests that just decoded a token, counting a step for each backed-off one: after its
        probe interval (`probe_interval`, doubled per failed probe) it proposes one token again."""
        for r in (r for r in req_ids if r in self._idle):  # backed-off requests only
            self._idle[r] += 1
            if self._idle[r] >= self._interval.get(r, self.probe_interval):
                del self._idle[r]
                self._length[r] = 1
                self._probing.add(r)
        return self.lengths(req_ids)

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
        new = np.where(accepted == drafts, grown, np.where(accepted == 0, current // 2, current))
        changed = np.nonzero((drafts > 0) & (new != current))[0]
        for i in changed.tolist():  # only requests whose length moved
            rid, n = req_ids[i], int(new[i])
            self._length[rid] = n
            if n == 0:  # backed off: probe later, twice as late when this was a failed probe
                if rid in self._probing:
                    self._interval[rid] = min(MAX_PROBE_INTERVAL, 2 * self._interval.get(rid, self.probe_interval))
                self._idle[rid] = 0
        if self._probing or self._interval:
            for i in np.nonzero(drafts > 0)[0].tolist():
                self._probing.discard(req_ids[i])
                if accepted[i] > 0:  # a draft token held: probes (if it backs off again) start over
                    self._interval.pop(req_ids[i], None)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Finished (or re-added) requests: drop their lengths."""
        for r in req_ids:
            self._length.pop(r, None)
            self._idle.pop(r, None)
            self._interval.pop(r, None)
            self._probing.discard(r)
