"""N-gram (prompt lookup) proposals: guess the next tokens by finding the request's recent tokens earlier in it.

vLLM's `method: "ngram"`. For each request, the last n tokens of its history (prompt + outputs) are looked up
among its earlier tokens, for n from `prompt_lookup_max` down to `prompt_lookup_min`; the most recent earlier
occurrence of the longest n that matches wins, and the (up to) k tokens that followed it are the proposal.

The search is vectorised over the whole batch with numpy (loops over at most `prompt_lookup_max` offsets, never
over tokens or requests): one [B, W] comparison per token of the shortest n-gram finds the earlier occurrences of
each request's last `prompt_lookup_min` tokens, only those few are extended towards `prompt_lookup_max`, and the
longest, latest one wins. A request shorter than `prompt_lookup_min` + 1 tokens costs nothing. Small batches
(<= ROW_SEARCH_MAX_BATCH requests) search request by request instead: per n-gram size one `bytes.rfind` over the
history's bytes (C-level, latest first), which at batch 1 on a 200-token history takes ~11 us against the
vectorised search's fixed ~60-80 us (measured on Zen 4); both return the same proposals (tested against a naive
reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

ROW_SEARCH_MAX_BATCH = 16  # measured: per-row search 11 us at batch 1, 49 at 16, 88 at 32; vectorised 60-85 us


@dataclass(frozen=True)
class NgramProposal:
    """Proposed draft tokens per request: `draft_token_ids[i, :num_draft_tokens[i]]`, the rest -1."""

    draft_token_ids: np.ndarray  # int64 [B, k]
    num_draft_tokens: np.ndarray  # int64 [B]

    def to_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.draft_token_ids, self.num_draft_tokens)]


class NgramProposer:
    """Proposes up to `num_speculative_tokens` tokens per request by prompt lookup; holds no per-request state."""

    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_model_len: int | None = None,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens!r}.")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min!r}.")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max!r}) must be >= prompt_lookup_min ({prompt_lookup_min!r})."
            )
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len!r}.")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len
        # Batches up to this size search request by request (`_search_row`: a few microseconds each); larger ones
        # take the vectorised [B, W] search, whose fixed cost (~100 us at batch 1) is then shared.
        self.row_search_max_batch = ROW_SEARCH_MAX_BATCH

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> NgramProposal:
        """Proposals for a batch: `token_ids[i, :num_tokens[i]]` is request i's history (the rest is ignored).

        `token_ids` may be the runner's persistent [max_num_reqs, max_model_len] buffer (any integer dtype); only
        its first max(num_tokens) columns are read. A request whose proposal would pass `max_model_len` gets
        fewer tokens (none when it is already there).
        """
        token_ids = np.asarray(token_ids)
        num_tokens = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
        if token_ids.ndim != 2 or token_ids.shape[0] != num_tokens.shape[0]:
            raise ValueError(
                f"token_ids must be [B, W] with B = len(num_tokens), got {token_ids.shape} and {num_tokens.shape}."
            )
        b = num_tokens.shape[0]
        if b and (num_tokens.min() < 0 or num_tokens.max() > token_ids.shape[1]):
            raise ValueError(f"num_tokens must be in [0, {token_ids.shape[1]}], got {num_tokens!r}.")
        drafts = np.full((b, self.k), -1, dtype=np.int64)
        counts = np.zeros(b, dtype=np.int64)
        width = int(num_tokens.max()) if b else 0
        if b <= self.row_search_max_batch:  # a few requests: one C-level substring search per n, per request
            for i in range(b):
                found = self._search_row(token_ids[i], int(num_tokens[i]))
                counts[i] = len(found)
                drafts[i, : len(found)] = found
            return NgramProposal(drafts, counts)
        if width < self.min_n + 1:  # a match needs n tokens before the suffix's last one
            return NgramProposal(drafts, counts)
        hist = token_ids[:, :width]
        req, end, length = self._candidates(hist, num_tokens)
        if len(req) == 0:
            return NgramProposal(drafts, counts)
        # Per request: the longest match (capped at max_n), then its latest end position.
        score = length * width + end
        best = np.full(b, -1, dtype=np.int64)
        np.maximum.at(best, req, score)
        found = best >= 0
        latest = np.where(found, best % width, 0)

        # Tokens after the match: up to k, within the history, and not past max_model_len.
        limit = np.minimum(num_tokens, latest + 1 + self.k)
        if self.max_model_len is not None:
            limit = np.minimum(limit, latest + 1 + np.maximum(self.max_model_len - num_tokens, 0))
        idx = latest[:, None] + 1 + np.arange(self.k)[None, :]
        take = found[:, None] & (idx < limit[:, None])
        gathered = hist[np.arange(b)[:, None], np.minimum(idx, width - 1)]
        drafts[take] = gathered[take]
        counts[:] = take.sum(axis=1)
        return NgramProposal(drafts, counts)

    def propose_row(self, row: np.ndarray, n: int) -> list[int]:
        """One request's proposal from its history `row[:n]` (a row of the runner's persistent buffer, read in
        place), as a list: the small-batch path without `propose`'s [B, k] tables and checks (the same tokens)."""
        return self._search_row(row, n).tolist()

    def _search_row(self, row: np.ndarray, n: int) -> np.ndarray:
        """One request's proposal from its history row[:n]: for n-gram sizes from max_n down to min_n, the latest
        earlier occurrence of its last m tokens, found by `bytes.rfind` over the history's bytes (a match at an
        offset that is not a whole token is skipped by searching again before it). The history is copied to bytes
        once per call (n * itemsize bytes: ~0.1 us at 512 int64 tokens); the search itself runs in C, latest
        occurrence first, and stops at the first whole-token match of the longest n-gram that has one."""
        budget = self.k if self.max_model_len is None else min(self.k, self.max_model_len - n)
        if budget <= 0 or n < self.min_n + 1:
            return row[:0]
        hist = row[:n] if row.flags.c_contiguous else np.ascontiguousarray(row[:n])
        size = hist.itemsize
        haystack = hist[: n - 1].tobytes()  # an occurrence must end before the history's last token
        tail = hist[n - min(self.max_n, n - 1) :].tobytes()  # the longest suffix; shorter ones are its tails
        for m in range(min(self.max_n, n - 1), self.min_n - 1, -1):
            needle = tail[len(tail) - m * size :]
            end = len(haystack)
            while (pos := haystack.rfind(needle, 0, end)) >= 0:
                if pos % size == 0:
                    after = pos // size + m
                    return hist[after : min(after + budget, n)]
                end = pos + len(needle) - 1  # straddles tokens: look again, strictly before this offset
        return row[:0]

    def propose_lists(self, histories: Sequence[Sequence[int]]) -> list[list[int]]:
        """Convenience form: one list of token ids per request in, one proposal list per request out."""
        lens = np.array([len(h) for h in histories], dtype=np.int64)
        buf = np.zeros((len(histories), int(lens.max()) if len(lens) else 0), dtype=np.int64)
        for i, h in enumerate(histories):
            buf[i, : len(h)] = h
        return self.propose(buf, lens).to_lists()

    def _candidates(self, hist: np.ndarray, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every earlier occurrence of a request's last `min_n` tokens, and how far each match extends back.

        Returns (request, end position j, match length capped at max_n) per occurrence, j <= num_tokens - 2 (an
        occurrence must end before the suffix's last token). One [B, W] comparison per token of the shortest
        n-gram finds the occurrences (usually few); only those are extended towards max_n."""
        b, width = hist.shape
        rows = np.arange(b)
        last = np.maximum(num_tokens - 1, 0)
        # ok[:, j] for end positions j in [0, W - 2]: hist[j - t] == hist[last - t] for t < min_n.
        ok = hist[:, : width - 1] == hist[rows, last][:, None]
        for t in range(1, self.min_n):
            ok[:, t:] &= hist[:, : width - 1 - t] == hist[rows, np.maximum(last - t, 0)][:, None]
        req, end = np.nonzero(ok)
        # A whole min_n-gram ends at j >= min_n - 1, before the suffix's last token (stale columns past a
        # request's history are dropped here, on the few candidates rather than the [B, W] mask).
        keep = (end >= self.min_n - 1) & (end <= num_tokens[req] - 2)
        req, end = req[keep], end[keep]
        length = np.full(len(req), self.min_n, dtype=np.int64)
        alive = np.ones(len(req), dtype=bool)
        for t in range(self.min_n, self.max_n):  # extend the candidates only; j - t >= 0 implies last - t >= 1
            alive &= end >= t
            if not alive.any():
                break
            alive &= hist[req, np.maximum(end - t, 0)] == hist[req, np.maximum(last[req] - t, 0)]
            length += alive
        return req, end, length
