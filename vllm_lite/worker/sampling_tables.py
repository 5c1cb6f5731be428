"""Per-row variable-length sampling data as flat numpy tables (no per-row Python objects).

`RowEntries` holds per-row lists (allowed tokens, bad words, logit bias, stop ids) as one
table of (row, token, value[, prefix]) entries, so a step's batch is gathered with a few numpy
ops. `SeenTokens` holds each penalty row's distinct prompt+output tokens and output counts, so
penalties cost O(batch x distinct tokens), not O(batch x vocab). Both move rows on condensing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class RowEntries:
    """A flat table of (row, token, value[, prefix]) entries: per-row lists without per-row objects."""

    def __init__(self) -> None:
        self.rows = np.zeros(0, np.int64)
        self.tokens = np.zeros(0, np.int64)
        self.values = np.zeros(0, np.float32)
        # Optional int prefix per entry (multi-token bad words), padded with -1; width grows on demand.
        self.prefixes = np.zeros((0, 0), np.int64)
        self.prefix_lens = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.rows)

    def add(
        self,
        row: int,
        tokens: Sequence[int],
        values: Optional[Sequence[float]] = None,
        prefixes: Optional[Sequence[Sequence[int]]] = None,
    ) -> None:
        n = len(tokens)
        if n == 0:
            return
        self.rows = np.concatenate([self.rows, np.full(n, row, np.int64)])
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int64)])
        vals = np.zeros(n, np.float32) if values is None else np.asarray(values, np.float32)
        self.values = np.concatenate([self.values, vals])
        pre = list(prefixes) if prefixes is not None else [[] for _ in range(n)]
        width = max([self.prefixes.shape[1]] + [len(p) for p in pre])
        new = np.full((n, width), -1, np.int64)
        for i, p in enumerate(pre):  # only at add time, never per step
            new[i, : len(p)] = p
        old = np.full((len(self.prefixes), width), -1, np.int64)
        old[:, : self.prefixes.shape[1]] = self.prefixes
        self.prefixes = np.concatenate([old, new])
        self.prefix_lens = np.concatenate([self.prefix_lens, np.asarray([len(p) for p in pre], np.int64)])

    def remove(self, row: int) -> None:
        if len(self.rows) == 0:
            return
        keep = self.rows != row
        if keep.all():
            return
        self.rows, self.tokens, self.values = self.rows[keep], self.tokens[keep], self.values[keep]
        self.prefixes, self.prefix_lens = self.prefixes[keep], self.prefix_lens[keep]

    def move(self, src: int, dst: int) -> None:
        self.rows[self.rows == src] = dst

    def select(self, pos_of_row: np.ndarray) -> np.ndarray:
        """Indices of entries whose row is in the current batch."""
        if len(self.rows) == 0:
            return np.zeros(0, np.int64)
        return np.nonzero(pos_of_row[self.rows] >= 0)[0]


class SeenTokens:
    """Per row: the distinct tokens of prompt+output and how often each was generated.

    Penalties touch only these tokens, so the sampler gathers/scatters [N, L]
    entries (L = longest such set) instead of sweeping [N, vocab]. Capacity
    grows by doubling, so memory follows the longest set actually seen.
    """

    def __init__(self, max_num_reqs: int) -> None:
        self.tokens = np.zeros((max_num_reqs, 64), np.int64)
        self.counts = np.zeros((max_num_reqs, 64), np.int32)  # output occurrences (0 = prompt only)
        self.lens = np.zeros(max_num_reqs, np.int64)

    def _reserve(self, need: int) -> None:
        cap = self.tokens.shape[1]
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        grow = cap - self.tokens.shape[1]
        self.tokens = np.pad(self.tokens, ((0, 0), (0, grow)))
        self.counts = np.pad(self.counts, ((0, 0), (0, grow)))

    def load(self, row: int, prompt: np.ndarray, outputs: np.ndarray) -> None:
        uniq, inverse = np.unique(np.concatenate([outputs, prompt]), return_inverse=True)
        counts = np.bincount(inverse[: len(outputs)], minlength=len(uniq)).astype(np.int32)
        self._reserve(len(uniq))
        self.tokens[row, : len(uniq)] = uniq
        self.counts[row, : len(uniq)] = counts
        self.lens[row] = len(uniq)

    def clear(self, row: int) -> None:
        self.lens[row] = 0

    def move(self, src: int, dst: int) -> None:
        n = self.lens[src]
        self.tokens[dst, :n] = self.tokens[src, :n]
        self.counts[dst, :n] = self.counts[src, :n]
        self.lens[dst] = n
        self.lens[src] = 0

    def append(self, rows: np.ndarray, toks: np.ndarray) -> None:
        """Count one new output token per (distinct) row: bump its slot, or open a new slot."""
        width = int(self.lens[rows].max())
        match = (self.tokens[rows, :width] == toks[:, None]) & (np.arange(width)[None, :] < self.lens[rows, None])
        found = match.any(axis=1)
        slot = np.where(found, match.argmax(axis=1), self.lens[rows])
        self._reserve(int(slot.max()) + 1)
        self.tokens[rows, slot] = toks
        self.counts[rows, slot] = np.where(found, self.counts[rows, slot] + 1, 1)
        self.lens[rows] += ~found

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[N, L] token ids and output counts; padding repeats slot 0 so duplicate scatters write equal values."""
        lens = self.lens[rows]
        width = max(int(lens.max()), 1)
        tokens = self.tokens[rows, :width]
        counts = self.counts[rows, :width]
        pad = np.arange(width)[None, :] >= lens[:, None]
        empty = lens == 0  # nothing seen: point at token 0 with count 0 (caller makes repetition neutral)
        first_tok = np.where(empty, 0, tokens[:, 0])[:, None]
        first_cnt = np.where(empty, 0, counts[:, 0])[:, None]
        return np.where(pad, first_tok, tokens), np.where(pad, first_cnt, counts)
