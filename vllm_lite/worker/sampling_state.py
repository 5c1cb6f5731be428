"""Per-row sampling state of the persistent batch, kept across steps.

`InputBatch` owns one and keeps its rows equal to the batch's rows (add, remove and
condense go through the batch, never here directly). Scalars
(temperature, top-k, penalties, ...) live in numpy arrays indexed by row;
variable-length lists (allowed tokens, bad words, logit bias, stop ids) live in
flat `RowEntries` tables so one step's batch is gathered with a few numpy ops.
Penalty rows keep their distinct prompt+output tokens and output counts,
updated incrementally in `append_token_ids` (allocated only once some request
needs penalties), so penalties cost O(batch x distinct tokens), not O(batch x vocab).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.sampler import exponential_noise
from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.sampling_tables import RowEntries, SeenTokens

_EPS = 1e-5

# (attribute, dtype, neutral value) of every per-row scalar; move/remove walk this list.
_ROW_FIELDS: tuple[tuple[str, type, object], ...] = (
    ("active", np.bool_, False),
    ("temperature", np.float32, 1.0),
    ("top_k", np.int64, 0),
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("presence", np.float32, 0.0),
    ("frequency", np.float32, 0.0),
    ("repetition", np.float32, 1.0),
    ("min_tokens", np.int64, 0),
    ("num_output", np.int64, 0),
    ("num_logprobs", np.int64, -1),
    ("has_allowed", np.bool_, False),
    ("penalized", np.bool_, False),
    ("tracks_history", np.bool_, False),
)


class SamplingState:
    """Per-row sampling parameters and token history kept across steps, as tensors/numpy arrays."""

    def __init__(self, max_num_reqs: int, vocab_size: int, max_model_len: int, device: torch.device) -> None:
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be >= 1, got {max_num_reqs!r}.")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size!r}.")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len!r}.")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        for name, dtype, neutral in _ROW_FIELDS:
            setattr(self, name, np.full(max_num_reqs, neutral, dtype=dtype))
        self.generators: dict[int, torch.Generator] = {}
        self.allowed = RowEntries()
        self.bad_single = RowEntries()
        self.bad_multi = RowEntries()  # token = last token of the word; prefix = the tokens before it
        self.logit_bias = RowEntries()
        self.stop_ids = RowEntries()  # EOS + stop ids, banned while num_output < min_tokens
        # Allocated lazily: most workloads never need them.
        self.seen: Optional[SeenTokens] = None  # penalty rows' distinct tokens and output counts
        self.history: Optional[np.ndarray] = None  # int64 [R, max_model_len] output tokens, bad-word rows only
        self._pos = np.full(max_num_reqs, -1, np.int64)
        # Async scheduling: copies host arrays to the device without a host sync (PinnedRing.stage); None: as ever.
        self.stage: Optional[Callable[[np.ndarray], torch.Tensor]] = None
        # make_metadata's last result when it depends only on the rows' fixed parameters (no penalties, no
        # multi-token bad words, no min_tokens ban left): (rows, version, stage, metadata). Reused while the same
        # rows come again and no row was added, removed or moved (`_version`); see make_metadata.
        self._version = 0
        self._md_cache: Optional[tuple[bytes, int, object, SamplingMetadata]] = None
        self.reuse_metadata = True  # False: build every step (tests compare the two)
        # (version, whether any row has penalties or multi-token bad words): the per-step calls ask it every step,
        # and it changes only when a row is added, removed or moved (each bumps _version); see _values_rows.
        self._values_cache: tuple[int, bool] = (-1, False)

    # ------------------------------------------------------------------ row lifecycle
    def _check_row(self, row: int, field: str = "row") -> int:
        if not isinstance(row, (int, np.integer)) or not 0 <= int(row) < self.max_num_reqs:
            raise ValueError(f"{field} must be in [0, {self.max_num_reqs}), got {row!r}.")
        return int(row)

    def _check_tokens(self, field: str, ids: Sequence[int]) -> None:
        for t in ids:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"{field} contains token id {t!r} outside the vocabulary (size {self.vocab_size}).")

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_id: int | None,
    ) -> None:
        """Load a request into `row` (also after preemption: existing outputs restore counts and the seed stream)."""
        row = self._check_row(row)
        self._version += 1
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}.")
        if self.active[row]:
            self.remove_request(row)
        outputs = list(output_token_ids)
        self._check_tokens("output_token_ids", outputs)
        greedy = params.temperature < _EPS
        self.active[row] = True
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.top_k[row] = 0 if greedy or params.top_k < 0 else params.top_k
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_output[row] = len(outputs)
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs

        if params.allowed_token_ids is not None:
            self._check_tokens("allowed_token_ids", params.allowed_token_ids)
            self.allowed.add(row, params.allowed_token_ids)
            self.has_allowed[row] = True
        if params.logit_bias:
            self._check_tokens("logit_bias", list(params.logit_bias))
            self.logit_bias.add(row, list(params.logit_bias.keys()), [float(v) for v in params.logit_bias.values()])
        stop = list(params.all_stop_token_ids) + ([] if eos_token_id is None else [eos_token_id])
        if params.min_tokens > 0 and stop:
            self._check_tokens("stop token ids", stop)
            self.stop_ids.add(row, sorted(set(stop)))
        self._add_bad_words(row, params.bad_words_token_ids, outputs)

        self.penalized[row] = (
            params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
        )
        if self.penalized[row]:
            self._load_penalty_rows(row, prompt_token_ids, outputs)
        if params.seed is not None and not greedy:
            self.generators[row] = self._make_generator(params.seed, len(outputs))

    def _add_bad_words(self, row: int, words: list[list[int]], outputs: list[int]) -> None:
        for w in words:
            if len(w) == 0:
                raise ValueError(f"bad_words_token_ids must not contain an empty sequence, got {words!r}.")
            self._check_tokens("bad_words_token_ids", w)
        single = [w[0] for w in words if len(w) == 1]
        multi = [w for w in words if len(w) > 1]
        self.bad_single.add(row, single)
        if multi:
            self.bad_multi.add(row, [w[-1] for w in multi], prefixes=[w[:-1] for w in multi])
            if self.history is None:
                self.history = np.zeros((self.max_num_reqs, self.max_model_len), np.int64)
            n = min(len(outputs), self.max_model_len)
            self.history[row, :n] = outputs[:n]
            self.tracks_history[row] = True

    def _load_penalty_rows(self, row: int, prompt: list[int], outputs: list[int]) -> None:
        if self.seen is None:
            self.seen = SeenTokens(self.max_num_reqs)
        # Prompt ids beyond the sampled vocabulary cannot be generated, so they need no penalty (as HF).
        p = np.asarray(prompt, np.int64)
        p = p[(p >= 0) & (p < self.vocab_size)]
        self.seen.load(row, p, np.asarray(outputs, np.int64))

    def _make_generator(self, seed: int, num_drawn: int) -> torch.Generator:
        """A request's own stream; after preemption it skips the draws already used for its outputs."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for _ in range(num_drawn):  # the sampler draws one [V] noise vector per sampled token
            exponential_noise(torch.Size([self.vocab_size]), self.device, gen)
        return gen

    def remove_request(self, row: int) -> None:
        row = self._check_row(row)
        self._version += 1
        for name, _, neutral in _ROW_FIELDS:
            getattr(self, name)[row] = neutral
        for table in (self.allowed, self.bad_single, self.bad_multi, self.logit_bias, self.stop_ids):
            table.remove(row)
        self.generators.pop(row, None)
        if self.seen is not None:
            self.seen.clear(row)

    def move_row(self, src: int, dst: int) -> None:
        """Condensing the batch: src's state moves to row dst (whatever dst held is dropped)."""
        src, dst = self._check_row(src, "src"), self._check_row(dst, "dst")
        if src == dst:
            return
        self._version += 1
        if self.active[dst]:
            self.remove_request(dst)
        for name, _, _ in _ROW_FIELDS:
            arr = getattr(self, name)
            arr[dst] = arr[src]
        for table in (self.allowed, self.bad_single, self.bad_multi, self.logit_bias, self.stop_ids):
            table.move(src, dst)
        if src in self.generators:
            self.generators[dst] = self.generators.pop(src)
        if self.seen is not None:
            self.seen.move(src, dst)
        if self.tracks_history[src] and self.history is not None:
            self.history[dst] = self.history[src]
        for name, _, neutral in _ROW_FIELDS:
            getattr(self, name)[src] = neutral

    # ------------------------------------------------------------------ per step
    def append_token_ids(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record one new output token per listed row (rows must be distinct)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if rows.shape != toks.shape:
            raise ValueError(f"rows and token_ids must have the same length, got {len(rows)} and {len(toks)}.")
        if len(rows) == 0:
            return
        self._checked_rows(rows)
        if self._values_rows():  # only rows that keep their tokens' values read the output positions
            self._record_values(rows, toks, self.num_output[rows])
        elif toks.view(np.uint64).max() >= self.vocab_size:  # the ids' check alone (a negative id wraps huge)
            raise ValueError(f"token_ids must be in [0, {self.vocab_size}), got {toks!r}.")
        np.add.at(self.num_output, rows, 1)

    def _checked_rows(self, rows: np.ndarray) -> np.ndarray:
        # int64 seen as uint64: a negative row is huge, so one max() checks both ends.
        if len(rows) and rows.view(np.uint64).max() >= self.max_num_reqs:
            raise ValueError(f"rows must be in [0, {self.max_num_reqs}), got {rows!r}.")
        return rows

    def _values_rows(self) -> bool:
        """Whether any row has penalties or multi-token bad words (reads its output tokens' values), cached per
        `_version`: `penalized` and `tracks_history` change only in add_request, remove_request and move_row."""
        c = self._values_cache
        if c[0] == self._version:
            return c[1]
        flag = bool(self.penalized.any()) or bool(self.tracks_history.any())
        self._values_cache = (self._version, flag)
        return flag

    def count_sampled(self, rows: np.ndarray) -> None:
        """Async scheduling, at launch: one more output token per listed row whose value is not known yet (the
        min_tokens bans need only the count; `record_values` adds the values once they reach the host)."""
        rows = self._checked_rows(np.asarray(rows, dtype=np.int64).reshape(-1))
        np.add.at(self.num_output, rows, 1)

    def record_values(self, rows: np.ndarray, token_ids: np.ndarray, out_pos: np.ndarray) -> None:
        """Async scheduling: the values of tokens `count_sampled` counted, each the row's output number `out_pos`
        (0 = first output), into the histories penalties and multi-token bad words read."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        out_pos = np.asarray(out_pos, dtype=np.int64).reshape(-1)
        if not rows.shape == toks.shape == out_pos.shape:
            raise ValueError(f"rows, token_ids and out_pos must have the same length, got {rows!r}, {toks!r}.")
        if len(rows):
            self._record_values(self._checked_rows(rows), toks, out_pos)

    def check_token_ids(self, token_ids: np.ndarray) -> None:
        """record_values' check of the ids alone: what a step whose rows keep no values (`any_needs_token_values`
        False) still runs on its tokens (int64)."""
        toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if len(toks) and toks.view(np.uint64).max() >= self.vocab_size:
            raise ValueError(f"token_ids must be in [0, {self.vocab_size}), got {toks!r}.")

    def _record_values(self, rows: np.ndarray, toks: np.ndarray, out_pos: np.ndarray) -> None:
        if toks.view(np.uint64).max() >= self.vocab_size:  # a negative id seen as uint64 is huge
            raise ValueError(f"token_ids must be in [0, {self.vocab_size}), got {toks!r}.")
        if not self._values_rows():  # the usual batch: no row keeps its tokens' values
            return
        if self.history is not None:
            h = self.tracks_history[rows]
            if h.any():
                r, n = rows[h], out_pos[h]
                ok = n < self.max_model_len
                self.history[r[ok], n[ok]] = toks[h][ok]
        p = self.penalized[rows]
        if p.any():
            assert self.seen is not None
            if len(np.unique(rows[p])) != int(p.sum()):
                raise ValueError(f"rows must be distinct, got {rows!r}.")
            self.seen.append(rows[p], toks[p])

    def any_needs_token_values(self) -> bool:
        """Whether any row at all has penalties or multi-token bad words (needs_token_values can be True only
        then): the usual batch answers without looking its rows up (cached until a row is added, removed or
        moved)."""
        return self._values_rows()

    def needs_token_values(self, rows: np.ndarray) -> bool:
        """Whether sampling these rows reads their output tokens' values (penalties, multi-token bad words), not
        just their count: under async scheduling such a step first waits for the previous step's tokens."""
        rows = np.asarray(rows, dtype=np.int64)
        return bool(len(rows)) and bool((self.penalized[rows] | self.tracks_history[rows]).any())

    def _dev(self, arr: np.ndarray) -> torch.Tensor:
        if self.stage is not None:  # async scheduling on CUDA: through pinned memory (host_staging)
            return self.stage(arr)
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device, non_blocking=True)

    def make_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Gather the listed rows (in logits-row order) into one step's SamplingMetadata.

        The steady decode step asks for the same rows step after step, and most batches' metadata depends only
        on parameters fixed when a request is added (temperature, top-k/p, min-p, logprobs, allowed tokens,
        logit bias, single-token bad words, seeds). Such a result is kept and handed out again, device tensors
        and all (no numpy gathers, no host-to-device copies), while the same rows come in the same order and no
        row was added, removed or moved since. Metadata that reads per-step state (penalties' token counts,
        multi-token bad words' history, min_tokens bans on output counts) is built every step. The sampler only
        reads it (sampling_metadata.py)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = len(rows)
        c = self._md_cache
        # The rows compared as bytes (int64 each, in order): one memcmp, no numpy comparison and reduction.
        if c is not None and c[1] == self._version and c[2] is self.stage and self.reuse_metadata:
            key = rows.tobytes()
            if key == c[0]:
                return c[3]
        md, static = self._build_metadata(rows, n)
        self._md_cache = (rows.tobytes(), self._version, self.stage, md) if static and self.reuse_metadata else None
        return md

    def _build_metadata(self, rows: np.ndarray, n: int) -> tuple[SamplingMetadata, bool]:
        """make_metadata's work, and whether the result depends only on the rows' fixed parameters."""
        if n and (rows.min() < 0 or rows.max() >= self.max_num_reqs):
            raise ValueError(f"rows must be in [0, {self.max_num_reqs}), got {rows!r}.")
        if n and not self.active[rows].all():
            raise ValueError(f"rows {rows[~self.active[rows]].tolist()} hold no request.")
        V = self.vocab_size
        temp = self.temperature[rows]
        greedy = temp < _EPS
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())
        rnd = ~greedy

        k = self.top_k[rows]
        use_k = rnd & (k > 0) & (k < V)
        p = self.top_p[rows]
        use_p = rnd & (p < 1.0)
        mp = self.min_p[rows]
        use_mp = rnd & (mp > 0.0)
        lp = self.num_logprobs[rows]

        gens: dict[int, torch.Generator] = {}
        if self.generators:
            for i in np.nonzero(rnd)[0].tolist():  # only rows whose request has a seed
                g = self.generators.get(int(rows[i]))
                if g is not None:
                    gens[i] = g

        md = SamplingMetadata(
            num_rows=n,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if (all_greedy or all_random) else self._dev(greedy),
            temperature=None if all_greedy else self._dev(np.where(greedy, np.float32(1.0), temp)),
            top_k=self._dev(np.where(use_k, k, V)) if use_k.any() else None,
            max_top_k=int(k[use_k].max()) if use_k.any() else 0,
            top_p=self._dev(np.where(use_p, p, np.float32(1.0))) if use_p.any() else None,
            min_p=self._dev(np.where(use_mp, mp, np.float32(0.0))) if use_mp.any() else None,
            generators=gens,
            max_num_logprobs=int(lp.max()) if n and lp.max() >= 0 else None,
        )
        if not (all_greedy or all_random):
            md.random_rows_host = np.nonzero(rnd)[0].astype(np.int64)
            md.random_rows = self._dev(md.random_rows_host)
        if n == 0:
            return md, False

        static = True
        if self.penalized[rows].any():
            static = False  # the counts change every step
            assert self.seen is not None
            tokens, counts = self.seen.gather(rows)
            md.penalty_token_ids = self._dev(tokens)
            md.penalty_output_counts = self._dev(counts.astype(np.float32))
            md.presence_penalties = self._dev(self.presence[rows])
            md.frequency_penalties = self._dev(self.frequency[rows])
            no_tokens = self.seen.lens[rows] == 0
            md.repetition_penalties = self._dev(np.where(no_tokens, np.float32(1.0), self.repetition[rows]))

        pos = self._pos
        pos.fill(-1)
        pos[rows] = np.arange(n)

        if self.has_allowed[rows].any():
            sel = self.allowed.select(pos)
            md.allowed_rows = self._dev(self.has_allowed[rows])
            md.allowed_index = (self._dev(pos[self.allowed.rows[sel]]), self._dev(self.allowed.tokens[sel]))

        if len(self.logit_bias):
            sel = self.logit_bias.select(pos)
            if len(sel):
                md.logit_bias_index = (
                    self._dev(pos[self.logit_bias.rows[sel]]),
                    self._dev(self.logit_bias.tokens[sel]),
                )
                md.logit_bias_values = self._dev(self.logit_bias.values[sel])

        ban_b, ban_t, bans_static = self._banned(pos)
        if len(ban_b):
            md.banned_index = (self._dev(ban_b), self._dev(ban_t))
        return md, static and bans_static

    def _banned(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """(batch index, token) pairs to force to -inf: bad words and stop ids held back by min_tokens; and
        whether they stay the same in later steps of the same rows (single-token bad words only: multi-token
        ones follow the output, min_tokens bans end as the output count grows)."""
        parts_b: list[np.ndarray] = []
        parts_t: list[np.ndarray] = []
        static = True
        if len(self.bad_single):
            sel = self.bad_single.select(pos)
            parts_b.append(pos[self.bad_single.rows[sel]])
            parts_t.append(self.bad_single.tokens[sel])
        if len(self.bad_multi):
            sel = self.bad_multi.select(pos)
            if len(sel):
                static = False
                parts_b_m, parts_t_m = self._matched_bad_words(sel, pos)
                parts_b.append(parts_b_m)
                parts_t.append(parts_t_m)
        if len(self.stop_ids):
            sel = self.stop_ids.select(pos)
            r = self.stop_ids.rows[sel]
            sel = sel[self.num_output[r] < self.min_tokens[r]]
            # Output counts only grow while a row stays (add/remove/move bump _version): no ban now, none later.
            static = static and len(sel) == 0
            parts_b.append(pos[self.stop_ids.rows[sel]])
            parts_t.append(self.stop_ids.tokens[sel])
        if not parts_b:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), static
        return np.concatenate(parts_b), np.concatenate(parts_t), static

    def _matched_bad_words(self, sel: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Multi-token bad words whose leading tokens equal the tail of the output so far."""
        assert self.history is not None
        t = self.bad_multi
        r = t.rows[sel]
        prefix = t.prefixes[sel]
        plen = t.prefix_lens[sel]
        n_out = self.num_output[r]
        j = np.arange(prefix.shape[1])
        idx = n_out[:, None] - plen[:, None] + j[None, :]
        valid = j[None, :] < plen[:, None]
        hist = self.history[r[:, None], np.clip(idx, 0, self.max_model_len - 1)]
        match = np.where(valid, hist == prefix, True).all(axis=1) & (n_out >= plen)
        return pos[r[match]], t.tokens[sel][match]
