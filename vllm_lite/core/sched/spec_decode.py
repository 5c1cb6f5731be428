"""The scheduler's side of speculative decoding: which drafts a request runs, and what a verified step undoes.

The runner proposes drafts after it samples (the n-gram proposer reads its persistent token buffer, where every
request's history already lives) and returns them in `ModelRunnerOutput.spec_token_ids`; the scheduler keeps
them on the request (`Request.spec_token_ids`) and, at the request's next decode step, schedules its last token
plus the drafts (1 + k tokens; the KV slots of all of them are allocated, the lookahead) and sends them in
`SchedulerOutput.scheduled_spec_decode_tokens`. After the step, `num_computed_tokens` drops back by the rejected
drafts, so their KV slots are rewritten by the next step and the prefix cache, which hashes only full blocks of
computed tokens, never holds a rejected token.

Grammar requests get one bitmask row per verified position (their matcher advanced through the drafts, then
rolled back); penalised requests are penalised per position by the runner. Requests whose next-token
distribution depends on their latest outputs in ways the verification pass does not model get no drafts:
`min_tokens` still unmet (stop-token bans move with the output count), multi-token bad words, and pooling.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from vllm_lite.config import SpeculativeConfig
from vllm_lite.core.request import Request
from vllm_lite.spec_decode.metrics import SpecDecodingStats
from vllm_lite.structured_output.backend_types import StructuredOutputMatcher
from vllm_lite.structured_output.manager import StructuredOutputManager, bitmask_width


def may_speculate(req: Request) -> bool:
    """Whether the verification pass emits exactly what plain decoding would for this request.

    Penalties are exact per position (the runner counts the drafts before each one) and grammars are too (one
    bitmask row per position, `grammar_bitmask_with_drafts`). Still excluded: unmet min_tokens (its stop-token
    ban would have to lift mid-step) and multi-token bad words (their prefix match would have to move with the
    drafts), which the runner applies from the request's outputs before the step only."""
    sp = req.sampling_params
    return (
        getattr(req, "pooling_params", None) is None
        and req.num_output_tokens >= sp.min_tokens
        and all(len(w) <= 1 for w in (sp.bad_words_token_ids or []))
    )


def grammar_bitmask_with_drafts(
    manager: StructuredOutputManager, constrained: Sequence[tuple[str, StructuredOutputMatcher, list[int]]]
) -> tuple[dict[str, int], np.ndarray]:
    """The step's grammar rows: (request -> its first row, int32 [rows, W]).

    A request without drafts has one row (its matcher's current state). A request with drafts d_1..d_n has 1 + n:
    row j is what the grammar allows after d_1..d_j, so each verified position is masked as plain decoding would
    mask it had the drafts before it been sampled. The matcher advances through the drafts to fill those rows and
    is rolled back after, so it still holds only the request's outputs (the accepted drafts are fed to it one by
    one in update_from_output, as sampled tokens are). After a draft the grammar refuses, the rows allow all: the
    verification rejects that draft (its target probability is 0), so no later position is ever emitted."""
    ids: dict[str, int] = {}
    plain_rows: list[int] = []
    plain: list[StructuredOutputMatcher] = []
    drafted: list[tuple[int, StructuredOutputMatcher, list[int]]] = []
    rows = 0
    for rid, matcher, drafts in constrained:
        ids[rid] = rows
        if drafts:
            drafted.append((rows, matcher, drafts))
            rows += 1 + len(drafts)
        else:
            plain_rows.append(rows)
            plain.append(matcher)
            rows += 1
    full = torch.full((rows, bitmask_width(manager.vocab_size)), -1, dtype=torch.int32)
    if plain:  # the usual batched fill
        full[plain_rows] = torch.from_numpy(manager.fill_bitmask(plain))
    for first, matcher, drafts in drafted:
        matcher.fill_bitmask(full, first)
        accepted = 0
        for tok in drafts:
            if not matcher.accept_tokens([tok]):
                break
            accepted += 1
            matcher.fill_bitmask(full, first + accepted)
        matcher.rollback(accepted)
    return ids, full.numpy()


class SpecDecodeScheduling:
    """Drafts to schedule per request, the rollback after verification, and the step's acceptance counters."""

    def __init__(self, config: Optional[SpeculativeConfig]) -> None:
        self.num_spec_tokens = config.num_speculative_tokens if config is not None else 0
        self.enabled = bool(self.num_spec_tokens)
        # A draft model writes KV for its k proposal positions past a request's tokens: reserve those slots.
        self.num_lookahead_tokens = self.num_spec_tokens if config is not None and config.method == "draft_model" else 0
        self._stats: Optional[SpecDecodingStats] = None
        # Since start (never reset): what tests and tools read.
        self.total = SpecDecodingStats.new(self.num_spec_tokens) if self.enabled else None

    def drafts_for(self, req: Request, max_model_len: int) -> list[int]:
        """Drafts to run after `req`'s last token this step: none unless it decodes; capped so that the bonus token
        still fits under max_tokens and max_model_len."""
        drafts = req.spec_token_ids
        if not drafts or req.num_computed_tokens != req.num_tokens - 1 or not may_speculate(req):
            return []
        room = max_model_len - req.num_tokens
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - req.num_output_tokens - 1)
        return drafts[: max(0, min(room, self.num_spec_tokens))]

    def lookahead(self, num_tokens_after: int, max_model_len: int) -> int:
        """Extra KV slots to allocate past `num_tokens_after` (the computed tokens after this step) for the
        draft model's passes; none past max_model_len."""
        return max(0, min(self.num_lookahead_tokens, max_model_len - num_tokens_after))

    def rollback(self, req: Request, num_drafts: int, num_sampled: int) -> None:
        """After a verified step: `num_sampled` tokens came back for `num_drafts` drafts (accepted + 1)."""
        num_accepted = max(0, min(num_drafts, num_sampled - 1))
        req.num_computed_tokens -= num_drafts - num_accepted
        if self._stats is None:
            self._stats = SpecDecodingStats.new(self.num_spec_tokens)
        self._stats.observe_draft(num_drafts, num_accepted)
        assert self.total is not None
        self.total.observe_draft(num_drafts, num_accepted)

    def take_stats(self, reset: bool = True) -> Optional[SpecDecodingStats]:
        """The counters since the last reset (None when nothing was verified)."""
        stats = self._stats
        if reset:
            self._stats = None
        return stats
