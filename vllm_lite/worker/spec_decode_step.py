"""The runner's side of speculative decoding: lay drafts into the batch, verify them, propose the next ones.

A step whose SchedulerOutput carries `scheduled_spec_decode_tokens` runs each such request's last token plus its
k drafts as one query of length 1 + k through the ordinary mixed-batch forward pass (the drafts are written into
the persistent token buffer right after the request's known tokens, so `build_step_inputs` picks them up).
Every sampling row is then verified at once: the logits of its 1 + k positions go through the sampler's own
processors and warpers (the metadata rows repeated per position), and `rejection_sample` keeps the longest
prefix of drafts that the target's samples agree with, plus one token. Rows without drafts take the same path
with k = 0, which is plain sampling.

Penalties at position j count the drafts before it (`penalties_with_drafts`), and grammar rows come one per
position from the scheduler (`grammar_rows`). min_tokens bans and multi-token bad words are only exact at
position 0; the scheduler gives such requests no drafts (see `core/sched/spec_decode.py`).

Proposals come from the n-gram proposer over the same persistent buffer (every request's history, prompt and
outputs, already lives there, row by row, which its batched numpy search reads), or from the draft model
(`draft_model.py`), whose sampled proposals' q this step hands to the rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from vllm_lite.config import VllmConfig
from vllm_lite.spec_decode.draft_budget import DraftBudget
from vllm_lite.spec_decode.draft_length import AdaptiveDraftLength
from vllm_lite.spec_decode.ngram_proposer import NgramProposer
from vllm_lite.spec_decode.rejection_sampler import (
    greedy_verify_host,
    greedy_verify_lists,
    match_sample_host,
    rejection_sample_rows,
)
from vllm_lite.spec_decode.uniform_drafts import UniformDrafts, verify_graph_sizes
from vllm_lite.worker.attention.backend import AttentionBackend
from vllm_lite.worker.draft_model import DraftModel
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.parallel_state import get_tp_size
from vllm_lite.worker.sampler import Sampler, gather_logprobs, warp
from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.step import LogprobsTensors, SchedulerOutput
from vllm_lite.worker.step_inputs import StepInputs

# Up to this many rows, the per-step host layouts (record_emitted, logits_positions) walk Python lists: a
# handful of numpy calls on [S, K+1] arrays costs more than a short loop at small batch.
SMALL_BATCH = 8


@dataclass
class VerifiedTokens:
    """One verified step's result for the rows that sampled (in step order)."""

    token_ids: np.ndarray  # int64 [S, K+1], -1 past each row's emitted tokens
    num_emitted: np.ndarray  # int64 [S], accepted drafts + 1
    num_rejected: np.ndarray  # int64 [S]
    logprobs: Optional[LogprobsTensors]  # one row per emitted token, rows grouped by request in step order

    def token_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.token_ids, self.num_emitted)]


def penalties_with_drafts(
    token_ids: torch.Tensor, counts: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Penalty tables for verified positions: position j of row r sees drafts[r, :j] as generated tokens too.

    token_ids / counts: a row's distinct prompt+output tokens and their output counts, int64 / float32 [S, L]
    (padded by repeating entry 0). drafts: int64 [S, K] (-1 past num_draft). Returns [S*(K+1), L+K] tables:
    row r*(K+1)+j lists the row's tokens then drafts[r, :j] (the rest repeat entry 0), each with its output count
    plus its occurrences among drafts[r, :j], so every copy of a token carries the same count."""
    s, length = token_ids.shape
    k = drafts.shape[1]
    reps = k + 1
    pos = torch.arange(reps, device=drafts.device)
    # before[r, j, c]: draft c precedes position j (and exists).
    before = (torch.arange(k, device=drafts.device)[None, None, :] < pos[None, :, None]) & (
        torch.arange(k, device=drafts.device)[None, None, :] < num_draft[:, None, None]
    )
    seen = torch.where(before, drafts[:, None, :], -1)  # [S, reps, K]: drafts counted at each position
    extra_ids = torch.where(before, drafts[:, None, :], token_ids[:, None, :1])  # [S, reps, K]
    ids = torch.cat([token_ids[:, None, :].expand(s, reps, length), extra_ids], dim=2)  # [S, reps, L+K]
    # Output count of each listed token: its count in the row's table (0 when new) + its occurrences in `seen`.
    base_known = counts[:, None, :].expand(s, reps, length)
    match_new = extra_ids[..., :, None] == token_ids[:, None, None, :]  # [S, reps, K, L]
    base_new = (match_new * counts[:, None, None, :]).amax(dim=3)
    base = torch.cat([base_known, base_new], dim=2)
    occurrences = (ids[..., :, None] == seen[..., None, :]).sum(dim=3)  # [S, reps, L+K]
    return ids.reshape(s * reps, length + k), (base + occurrences).reshape(s * reps, length + k).float()


def record_emitted(batch: InputBatch, rows: np.ndarray, token_table: np.ndarray, num_emitted: np.ndarray) -> None:
    """Append each verified row's emitted tokens, `token_table[i, :num_emitted[i]]`, to the batch (distinct `rows`):
    the state that one `batch.record_sampled` call per column leaves, in one pass (a verify step emits ~3 tokens
    a row, and each record_sampled call is ~10 small numpy ops). Rows whose sampling state records every token
    (penalties, bad-word history) still go column by column through record_sampled."""
    rows = np.asarray(rows, dtype=np.int64)
    num_emitted = np.asarray(num_emitted, dtype=np.int64)
    sampling = batch.sampling
    tracked = sampling.penalized[rows] | sampling.tracks_history[rows]
    if tracked.any():
        t_rows, t_table, t_n = rows[tracked], token_table[tracked], num_emitted[tracked]
        for j in range(int(t_n.max())):
            keep = t_n > j
            batch.record_sampled(t_rows[keep], t_table[keep, j])
        rows, token_table, num_emitted = rows[~tracked], token_table[~tracked], num_emitted[~tracked]
    vocab = sampling.vocab_size
    if len(rows) <= SMALL_BATCH:  # a few rows: slices and scalars (2 rows: ~10 us against ~45 for the masks below)
        lists = [row[:n] for row, n in zip(token_table.tolist(), num_emitted.tolist())]
        _append_untracked(batch, rows.tolist(), lists)
        return
    emitted = np.arange(token_table.shape[1])[None, :] < num_emitted[:, None]
    toks = token_table[emitted]
    if len(toks) and not (0 <= int(toks.min()) and int(toks.max()) < vocab):
        raise ValueError(f"token_ids must be in [0, {vocab}), got {toks!r}.")
    pos = batch.num_tokens[rows][:, None] + np.arange(token_table.shape[1])[None, :]
    keep = emitted & (pos < batch.max_model_len)
    batch.token_ids[np.broadcast_to(rows[:, None], pos.shape)[keep], pos[keep]] = token_table[keep]
    batch.num_tokens[rows] += keep.sum(axis=1)
    sampling.num_output[rows] += num_emitted


def record_emitted_lists(batch: InputBatch, rows: Sequence[int], emitted: Sequence[Sequence[int]]) -> None:
    """`record_emitted` for a few rows with each row's emitted tokens as a list (`greedy_verify_lists`' result):
    slices and scalars, no [S, K+1] table. Rows whose sampling state records every token (penalties, bad-word
    history) go through `record_emitted` (one table, built here)."""
    sampling = batch.sampling
    penalized, tracked = sampling.penalized, sampling.tracks_history
    if any(penalized[r] or tracked[r] for r in rows):
        table = np.full((len(rows), max(map(len, emitted), default=0)), -1, dtype=np.int64)
        for i, toks in enumerate(emitted):
            table[i, : len(toks)] = toks
        counts = np.fromiter(map(len, emitted), np.int64, len(emitted))
        record_emitted(batch, np.asarray(rows, dtype=np.int64), table, counts)
        return
    _append_untracked(batch, rows, emitted)


def _append_untracked(batch: InputBatch, rows: Sequence[int], emitted: Sequence[Sequence[int]]) -> None:
    """Append each row's emitted tokens (rows that track no token history), slices and scalars: the few-row form
    of record_emitted and record_emitted_lists."""
    sampling = batch.sampling
    vocab, max_len = sampling.vocab_size, batch.max_model_len
    num_tokens, token_ids, num_output = batch.num_tokens, batch.token_ids, sampling.num_output
    for r, toks in zip(rows, emitted):
        n = len(toks)
        if n and not (0 <= min(toks) and max(toks) < vocab):
            raise ValueError(f"token_ids must be in [0, {vocab}), got {toks!r}.")
        start = int(num_tokens[r])
        stop = max(start, min(start + n, max_len))
        token_ids[r, start:stop] = toks[: stop - start]
        num_tokens[r] = stop
        num_output[r] += n


def changes_argmax(md: SamplingMetadata) -> bool:
    """Whether a logits processor (masks, bans, bias, penalties) may move some row's argmax this step."""
    return not (
        md.allowed_index is None
        and md.banned_index is None
        and md.logit_bias_index is None
        and md.penalty_token_ids is None
    )


def expand_metadata(
    md: SamplingMetadata,
    reps: int,
    drafts: Optional[torch.Tensor] = None,
    num_draft: Optional[torch.Tensor] = None,
) -> SamplingMetadata:
    """The same sampling rows, each repeated `reps` times in a row (row r -> rows r*reps .. r*reps+reps-1).

    With the rows' drafts (int64 [S, reps-1], and their counts), penalties at position j count the drafts
    before it as generated tokens (they are, if position j is reached)."""
    if reps == 1:
        return md
    penalty_ids, penalty_counts = None, None
    if md.penalty_token_ids is not None:
        assert md.penalty_output_counts is not None
        if drafts is None or num_draft is None:
            raise ValueError("penalties at verified positions need the rows' drafts")
        penalty_ids, penalty_counts = penalties_with_drafts(
            md.penalty_token_ids, md.penalty_output_counts, drafts, num_draft
        )

    def rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.repeat_interleave(reps, dim=0)

    def pairs(idx: Optional[tuple[torch.Tensor, torch.Tensor]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if idx is None:
            return None
        b, t = idx
        offsets = torch.arange(reps, device=b.device)
        return ((b.unsqueeze(1) * reps + offsets).reshape(-1), t.unsqueeze(1).expand(-1, reps).reshape(-1))

    bias_values = md.logit_bias_values
    return SamplingMetadata(
        num_rows=md.num_rows * reps,
        all_greedy=md.all_greedy,
        all_random=md.all_random,
        greedy_mask=rows(md.greedy_mask),
        temperature=rows(md.temperature),
        top_k=rows(md.top_k),
        max_top_k=md.max_top_k,
        top_p=rows(md.top_p),
        min_p=rows(md.min_p),
        generators={},
        max_num_logprobs=md.max_num_logprobs,
        presence_penalties=rows(md.presence_penalties),
        frequency_penalties=rows(md.frequency_penalties),
        repetition_penalties=rows(md.repetition_penalties),
        penalty_token_ids=penalty_ids,
        penalty_output_counts=penalty_counts,
        allowed_rows=rows(md.allowed_rows),
        allowed_index=pairs(md.allowed_index),
        banned_index=pairs(md.banned_index),
        logit_bias_index=pairs(md.logit_bias_index),
        logit_bias_values=None if bias_values is None else bias_values.repeat_interleave(reps),
    )


def _expanded_random_rows(
    md: SamplingMetadata, md_x: SamplingMetadata, reps: int
) -> tuple[torch.Tensor, Optional[np.ndarray]]:
    """The random rows of `md_x` (md's rows repeated `reps` times), ascending, on the device and the host: from the
    host's `random_rows_host` when the metadata has it (no read of the greedy mask back), else by nonzero."""
    host = md.random_rows_host
    assert md_x.greedy_mask is not None
    if host is None:
        return (~md_x.greedy_mask).nonzero().squeeze(1), None
    rows = (np.asarray(host, dtype=np.int64)[:, None] * reps + np.arange(reps)[None, :]).reshape(-1)
    return torch.from_numpy(rows).to(md_x.greedy_mask.device), rows


def target_distributions(
    logits: torch.Tensor,
    md: SamplingMetadata,
    bitmask: Optional[torch.Tensor],
    reps: int,
    drafts: Optional[torch.Tensor] = None,
    num_draft: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target [S, reps, V], greedy [S]): warped probabilities for random rows, processed logits for greedy rows
    (the rejection sampler reads only their argmax), exactly as the sampler would sample each position.

    bitmask: int32 [S*reps, W], one grammar row per verified position (after the drafts before it), or None.
    Penalties at each position count the drafts before it (`expand_metadata`)."""
    md_x = expand_metadata(md, reps, drafts, num_draft)
    processed = Sampler.apply_logits_processors(logits, md_x, bitmask)
    s = md.num_rows
    if md.all_greedy:
        return processed.view(s, reps, -1), torch.ones(s, dtype=torch.bool, device=logits.device)
    if md.all_random:
        greedy = torch.zeros(s, dtype=torch.bool, device=logits.device)
        random_rows, random_rows_host = None, None
    else:
        assert md.greedy_mask is not None and md_x.greedy_mask is not None
        greedy = md.greedy_mask
        random_rows, random_rows_host = _expanded_random_rows(md, md_x, reps)
    probs = warp(processed, md_x, random_rows, random_rows_host).to_dense().softmax(dim=-1)
    if random_rows is not None:
        probs = torch.where(md_x.greedy_mask.unsqueeze(1), processed, probs)  # type: ignore[union-attr]
    return probs.view(s, reps, -1), greedy


class SpecDecodeStep:
    """Drafts in, verified tokens out, new drafts proposed: the runner calls this around its forward pass."""

    # n-gram at batch > 1 (draft_budget.py): a step verifies drafts only when their expected accepted tokens pay
    # for the verify step at the engine's measured step costs, else it decodes plainly. Read at construction;
    # False leaves only disable_by_batch_size (benchmarks/spec_decode.py --no-gain-rule compares).
    gain_rule = True
    # n-gram at batch > 1: pad every request's draft to one common length, so that the verify step replays a CUDA
    # graph (spec_decode/uniform_drafts.py). None: where the runner captures verify graphs (CUDA, not
    # enforce_eager, ...); True: always (CPU tests force it, with no cap by graph sizes); False: never. Read at
    # construction (maybe_create).
    uniform_drafts: Optional[bool] = None
    uniform: Optional[UniformDrafts] = None  # set per instance when padding is on
    _real_drafts: Optional[dict[str, int]] = None  # padded requests' own draft lengths, from the last proposal
    _spare: Optional[dict[int, list[int]]] = None  # step index -> drafts found that the batch rule set aside

    def __init__(
        self,
        vllm_config: VllmConfig,
        draft: Optional[DraftModel] = None,
        verify_graphs: Optional[dict[int, list[int]]] = None,
    ) -> None:
        """verify_graphs: {q: batch sizes} of the runner's verify graphs (uniform_drafts.verify_graph_sizes), None
        without them."""
        sc = vllm_config.speculative_config
        assert sc is not None and sc.num_speculative_tokens is not None
        self.num_spec_tokens = sc.num_speculative_tokens
        self.disable_by_batch_size = sc.disable_by_batch_size
        self.draft = draft
        # A draft model's proposal lengths adapt per request (each position costs it a forward pass); n-gram
        # lookup costs next to nothing per position, and verifying k rows costs about what 2 do at small batch
        # on CPU (measured on the bundled model), so it always proposes up to k.
        self.lengths = AdaptiveDraftLength(sc.num_speculative_tokens) if draft is not None else None
        self.proposer: Optional[NgramProposer] = None
        # n-gram: no drafts once disable_by_batch_size requests run (vLLM's field); at batch > 1 a step verifies
        # drafts only when their expected accepted tokens pay for the verification (draft_budget.py).
        self.budget: Optional[DraftBudget] = None
        if sc.method == "ngram":
            self.budget = DraftBudget(
                sc.num_speculative_tokens,
                disable_by_batch_size=sc.disable_by_batch_size,
                gain_rule=self.gain_rule,
            )
            assert sc.prompt_lookup_min is not None and sc.prompt_lookup_max is not None
            self.proposer = NgramProposer(
                sc.num_speculative_tokens,
                sc.prompt_lookup_min,
                sc.prompt_lookup_max,
                max_model_len=vllm_config.model_config.max_model_len,
            )
            pad = self.uniform_drafts if self.uniform_drafts is not None else verify_graphs is not None
            if pad:
                sched = vllm_config.scheduler_config
                self.uniform = UniformDrafts(
                    sc.num_speculative_tokens,
                    sched.max_num_batched_tokens,
                    sched.long_prefill_token_threshold,
                    verify_graphs,
                )
        elif draft is None:
            raise ValueError(f"speculative_config.method {sc.method!r} needs its draft model")
        self._step_drafts = 0  # drafts verified in the current step (observe), for the budget's step times

    @staticmethod
    def maybe_create(
        vllm_config: VllmConfig, device: torch.device, backend: AttentionBackend
    ) -> Optional["SpecDecodeStep"]:
        """None without speculative_config; loads the draft model for method 'draft_model'."""
        sc = vllm_config.speculative_config
        if sc is None:
            return None
        draft = DraftModel(vllm_config, device, backend) if sc.method == "draft_model" else None
        return SpecDecodeStep(vllm_config, draft, verify_graph_sizes(vllm_config, device, backend.name, get_tp_size()))

    def set_verify_graphs(self, verify_graphs: Optional[dict[int, list[int]]]) -> None:
        """The runner's captured verify graphs ({q: batch sizes}, q >= 2), once known; None (capture failed, or
        none): no padding, unless `uniform_drafts` forces it."""
        if self.uniform is None or self.uniform_drafts:  # off, or forced
            return
        sizes = {q: sorted(bs) for q, bs in (verify_graphs or {}).items() if q > 1}
        if sizes:
            self.uniform.graph_sizes = sizes
        else:
            self.uniform = None

    def forget(self, req_ids: set[str]) -> None:
        """Finished or preempted requests: drop what the proposer kept for them."""
        if self.lengths is not None and req_ids:
            self.lengths.forget(req_ids)
        if self.budget is not None and req_ids:
            self.budget.forget(req_ids)
        if self.draft is not None and req_ids:
            self.draft.forget(req_ids)

    def observe(
        self, req_ids: list[str], num_draft: np.ndarray | list[int], num_accepted: np.ndarray | list[int]
    ) -> None:
        """A verified step's outcome per request (from the token table every rank holds): next proposal lengths.
        The counts may be int arrays or lists (the greedy list path's)."""
        if isinstance(num_draft, list) and (self.lengths is not None or self._real_drafts):
            num_draft, num_accepted = np.array(num_draft, dtype=np.int64), np.array(num_accepted, dtype=np.int64)
        elif isinstance(num_draft, list):  # n-gram, no padding fillers: the budget takes lists
            if self.budget is not None:
                self._step_drafts = sum(num_draft)
                self.budget.observe(req_ids, num_draft, num_accepted)
            return
        if self.lengths is not None:
            self.lengths.observe(req_ids, num_draft, num_accepted)
        if self.budget is not None:
            self._step_drafts = int(num_draft.sum())  # every verified row, fillers included: the step's cost
            real = self._real_drafts
            if real:  # fillers are not the lookup's drafts: the acceptance averages count only its own
                own = np.fromiter((real.get(r, -1) for r in req_ids), np.int64, len(req_ids))
                own = np.where(own >= 0, np.minimum(own, num_draft), num_draft)
                num_draft, num_accepted = own, np.minimum(num_accepted, own)
            self.budget.observe(req_ids, num_draft, num_accepted)

    def draft_probs(
        self, req_ids: list[str], drafts: np.ndarray, num_draft: np.ndarray
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(q [S, K, V], has_q bool [S]) for sampled draft-model proposals; (None, None) for point masses only.
        has_q is a CPU tensor (the draft model knows its rows on the host): the rejection sampler splits the rows
        with it without reading anything back from the device."""
        if self.draft is None:
            return None, None
        found = self.draft.draft_probs(req_ids, drafts, num_draft)
        if found is None:
            return None, None
        q, has_q = found
        return q, torch.from_numpy(has_q)

    # ------------------------------------------------------------------ before the forward pass
    @staticmethod
    def write_drafts(batch: InputBatch, so: SchedulerOutput) -> None:
        """Put each request's drafts right after its known tokens, where this step's inputs read them."""
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_row[req_id]
            n = int(batch.num_tokens[row])
            if n + len(drafts) > batch.max_model_len:
                raise ValueError(f"request {req_id!r}: {len(drafts)} drafts after {n} tokens pass max_model_len")
            batch.token_ids[row, n : n + len(drafts)] = drafts

    # ------------------------------------------------------------------ verification
    @staticmethod
    def draft_table(so: SchedulerOutput, req_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(drafts int64 [S, K] padded with -1, counts int64 [S]) for these requests, K = the step's longest."""
        lists = [so.scheduled_spec_decode_tokens.get(r, ()) for r in req_ids]
        lengths = [len(d) for d in lists]
        counts = np.array(lengths, dtype=np.int64)
        k = max(lengths, default=0)
        if k and min(lengths) == k:  # every row carries k drafts (batch 1 always): one conversion
            return np.array(lists, dtype=np.int64).reshape(len(lists), k), counts
        table = np.full((len(lists), k), -1, dtype=np.int64)
        for i, d in enumerate(lists):  # host-side layout of the scheduler's lists, before any tensor work
            if d:
                table[i, : len(d)] = d
        return table, counts

    @staticmethod
    def grammar_rows(so: SchedulerOutput, req_ids: list[str], num_draft: np.ndarray) -> Optional[torch.Tensor]:
        """The scheduler's grammar rows per verified position: int32 [S*(K+1), W] (all ones where unconstrained).

        A constrained request's rows start at `structured_output_request_ids[req]`: one for its current state,
        then one after each of its drafts (the scheduler advanced its matcher through them and rolled it back).
        Padding positions repeat the row's last one, as `logits_positions` repeats the last logits."""
        if so.grammar_bitmask is None or not so.structured_output_request_ids:
            return None
        src = torch.as_tensor(so.grammar_bitmask, dtype=torch.int32)
        first = so.structured_output_request_ids
        reps = (int(num_draft.max()) if len(num_draft) else 0) + 1
        dst, take = [], []
        for i, rid in enumerate(req_ids):  # host-side index layout, one entry per constrained row
            if rid in first:
                n = int(num_draft[i])
                dst.extend(range(i * reps, (i + 1) * reps))
                take.extend(first[rid] + min(j, n) for j in range(reps))
        if not dst:
            return None
        full = torch.full((len(req_ids) * reps, src.shape[1]), -1, dtype=torch.int32)
        full[dst] = src[take]
        return full

    @staticmethod
    def logits_positions(inputs: StepInputs, s_idx: np.ndarray, num_draft: np.ndarray) -> np.ndarray:
        """int64 [S, K+1]: the flat token index of each verified position (padding repeats the row's last)."""
        if len(s_idx) <= SMALL_BATCH:  # a few rows: Python lists, one array out
            counts = num_draft.tolist()
            k = max(counts, default=0)
            ends = inputs.query_start_loc.tolist()
            table = []
            for i, n in zip(s_idx.tolist(), counts):
                first = ends[i + 1] - 1 - n
                table.append([first + (j if j < n else n) for j in range(k + 1)])
            return np.array(table, dtype=np.int64).reshape(len(table), k + 1)
        k = int(num_draft.max()) if len(num_draft) else 0
        last = inputs.query_start_loc[1:][s_idx] - 1
        offsets = np.minimum(np.arange(k + 1)[None, :], num_draft[:, None])
        return last[:, None] - num_draft[:, None] + offsets

    @staticmethod
    def verify_greedy(logits: torch.Tensor, drafts: list[list[int]], reps: int) -> list[list[int]]:
        """Driver only. `verify` for all-greedy rows that no logits processor touches, a few of them, with the
        scheduler's draft lists: logits [S*reps, V] (row i's positions at i*reps .. i*reps + len(drafts[i])) ->
        each row's emitted tokens (`greedy_verify_lists`: one argmax, one read back, the match in Python)."""
        return greedy_verify_lists(logits.view(len(drafts), reps, -1), drafts)

    @staticmethod
    def verify(
        logits: torch.Tensor,
        md: SamplingMetadata,
        bitmask: Optional[torch.Tensor],
        drafts: np.ndarray,
        num_draft: np.ndarray,
        draft_probs: Optional[torch.Tensor] = None,
        has_draft_probs: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[LogprobsTensors]]:
        """Driver only. logits [S*(K+1), V] -> (tokens int64 [S, K+1] with -1 padding, logprobs per emitted token);
        the tokens may be on the host (all-greedy rows) or on the logits' device.
        bitmask: int32 [S*(K+1), W], each verified position's grammar row (`grammar_rows`), or None.

        draft_probs [S, K, V] with has_draft_probs [S]: the rows' sampled-proposal distributions q (other rows, and
        all rows when None, are point masses)."""
        s, k = drafts.shape
        device = logits.device
        if md.all_greedy and bitmask is None and not changes_argmax(md):
            # Argmax and compare, nothing else: the argmax comes back (the step's one sync) and the drafts never
            # go to the device; the tokens are host data, which the runner reads.
            out = greedy_verify_host(logits.view(s, k + 1, -1), drafts, num_draft)
        else:
            # The drafts go to the device only where a device op reads them: penalties at verified positions and
            # sampled draft-model proposals (q). Point masses (n-gram, and draft-model rows without q) are matched
            # on the host after one copy of the samples (match_sample_host), as the greedy path does.
            point_masses = draft_probs is None or has_draft_probs is None
            on_device = md.penalty_token_ids is not None or not point_masses
            drafts_t = num_draft_t = None
            if on_device:
                drafts_t, num_draft_t = torch.from_numpy(drafts).to(device), torch.from_numpy(num_draft).to(device)
            target, greedy = target_distributions(logits, md, bitmask, k + 1, drafts_t, num_draft_t)
            if point_masses:
                greedy_host = None
                if md.random_rows_host is not None:  # mixed: the host knows which rows are greedy
                    greedy_host = np.ones(s, dtype=bool)
                    greedy_host[md.random_rows_host] = False
                out = match_sample_host(
                    target, drafts, num_draft, greedy, md.all_greedy, md.all_random, md.generators, greedy_host
                )
            else:
                assert drafts_t is not None and num_draft_t is not None
                out = rejection_sample_rows(
                    drafts_t, num_draft_t, draft_probs, has_draft_probs, target, greedy, md.generators
                )
        tokens = out.output_token_ids
        lp = None
        if md.max_num_logprobs is not None:
            emitted = tokens >= 0  # on the tokens' side (host tokens: no device mask, no sync)
            flat_rows = torch.arange(s * (k + 1), device=tokens.device).view(s, k + 1)[emitted]
            raw = torch.log_softmax(logits[flat_rows.to(device)].float(), dim=-1)
            lp = gather_logprobs(raw, tokens[emitted].to(device), min(md.max_num_logprobs, logits.shape[1]))
        return tokens, lp

    # ------------------------------------------------------------------ after sampling
    def propose(
        self, batch: InputBatch, inputs: StepInputs, s_idx: np.ndarray, is_driver: bool = True
    ) -> list[list[int]]:
        """Drafts for every request of the step (aligned with inputs.req_ids; [] for rows that did not sample).

        The draft model runs even when no row sampled: its KV must catch up with every prefill chunk."""
        if self.draft is not None:
            assert self.lengths is not None
            lengths = self.lengths.for_step([inputs.req_ids[i] for i in s_idx.tolist()])
            if self.disable_by_batch_size is not None and inputs.num_reqs >= self.disable_by_batch_size:
                lengths = np.zeros_like(lengths)  # vLLM's disable_by_batch_size: no drafts at this batch size
            return self.draft.propose(batch, inputs, s_idx, is_driver, lengths)
        assert self.proposer is not None and self.budget is not None
        budget = self.budget
        budget.step_started(len(s_idx), inputs.num_reqs, inputs.num_tokens, self._step_drafts)
        self._step_drafts = 0
        self._real_drafts = self._spare = None
        try:
            out = self._propose_ngram(batch, inputs, s_idx)
            if self.uniform is not None and 2 <= len(s_idx) == inputs.num_reqs:
                self._pad_uniform(batch, inputs, s_idx, out)
            return out
        finally:
            budget.step_ended()

    def _pad_uniform(self, batch: InputBatch, inputs: StepInputs, s_idx: np.ndarray, out: list[list[int]]) -> None:
        """Every request's drafts in `out` at one common length (spec_decode/uniform_drafts.py), in place, when
        every request of the step sampled and may speculate; remembers the padded requests' own lengths. Requests
        that this step's tokens finish (max_tokens, max_model_len) are left out: they do not run again. A Python
        pass over the step's requests (batches with verify graphs are small: 16 at most by default)."""
        uniform = self.uniform
        assert uniform is not None
        idx = s_idx.tolist()
        if not any(out[i] for i in idx):  # a plain step next: nothing to pad
            return
        max_batch = uniform.max_batch
        if max_batch is not None and len(idx) > max_batch:  # no verify graph this large
            return
        sampling, params, max_len = batch.sampling, batch.params, batch.max_model_len
        num_output, min_tokens, tracked = sampling.num_output, sampling.min_tokens, sampling.tracks_history
        num_tokens, token_ids = batch.num_tokens, batch.token_ids
        live, drafts, last, room = [], [], [], []
        for i, r in zip(idx, inputs.rows[s_idx].tolist()):
            done = int(num_output[r])
            if done < min_tokens[r] or tracked[r]:  # the scheduler gives it no drafts (may_speculate): mixed anyway
                return
            n = int(num_tokens[r])
            left = max_len - n  # what drafts_for keeps: max_model_len, then max_tokens
            p = params[r]
            if p is not None and p.max_tokens is not None:
                if done >= p.max_tokens:
                    continue
                left = min(left, p.max_tokens - done - 1)
            if n >= max_len:
                continue
            live.append(i)
            drafts.append(out[i])
            last.append(int(token_ids[r, n - 1]))
            room.append(left)
        spare = None if self._spare is None else [self._spare.get(i, ()) for i in live]
        padded = uniform.pad(drafts, last, room, spare)
        if padded is None:
            return
        self._real_drafts = {inputs.req_ids[i]: n for i, n in zip(live, padded[1])}
        for i, d in zip(live, padded[0]):
            out[i] = d

    def _propose_ngram(self, batch: InputBatch, inputs: StepInputs, s_idx: np.ndarray) -> list[list[int]]:
        assert self.proposer is not None and self.budget is not None
        if inputs.num_reqs == 1 and len(s_idx) == 1 and self.proposer.row_search_max_batch >= 1:
            # Batch 1 (every step of a lone request): its row's search, nothing around it (it keeps what it finds:
            # disable_by_batch_size is at least 2, and the batch rule leaves batch 1 alone).
            if not self.budget.should_search(1, 1):
                return [[]]
            row = int(inputs.rows[0])
            return [self.proposer.propose_row(batch.token_ids[row], int(batch.num_tokens[row]))]
        out: list[list[int]] = [[] for _ in range(inputs.num_reqs)]
        if len(s_idx) == 0:
            return out
        idx = s_idx.tolist()
        req_ids = [inputs.req_ids[i] for i in idx]
        if not self.budget.should_search(len(req_ids), inputs.num_reqs):
            return out  # the expected gain did not pay for a verify step lately: no lookup, a plain step next
        rows = inputs.rows[s_idx]
        proposer = self.proposer
        if len(idx) <= proposer.row_search_max_batch:
            # A few requests: each one's substring search straight on its row of the persistent buffer (no
            # [B, W] copy of the histories, no [B, k] tables), lists out.
            token_ids = batch.token_ids
            found = [
                proposer.propose_row(token_ids[r], n) for r, n in zip(rows.tolist(), batch.num_tokens[rows].tolist())
            ]
            if len(idx) == 1 and not self.budget.disabled(inputs.num_reqs):
                out[idx[0]] = found[0]  # batch 1 keeps what it found (DraftBudget.trim)
                return out
            counts = self.budget.trim(req_ids, np.fromiter(map(len, found), np.int64, len(found)), inputs.num_reqs)
            for i, drafts, n in zip(idx, found, counts.tolist()):
                if n:
                    out[i] = drafts[:n]
            if self.uniform is not None:  # set aside by the rule: verified instead of fillers if the step pads
                self._spare = {i: d for i, d, n in zip(idx, found, counts.tolist()) if d and not n}
            return out
        num_tokens = batch.num_tokens[rows]
        proposal = proposer.propose(batch.token_ids[rows, : int(num_tokens.max())], num_tokens)
        counts = self.budget.trim(req_ids, proposal.num_draft_tokens, inputs.num_reqs)
        for i, row, n in zip(idx, proposal.draft_token_ids, counts.tolist()):
            if n:
                out[i] = row[:n].tolist()
        if self.uniform is not None:
            found = proposal.num_draft_tokens.tolist()
            self._spare = {
                i: row[:m].tolist()
                for i, row, m, n in zip(idx, proposal.draft_token_ids, found, counts.tolist())
                if m and not n
            }
        return out
