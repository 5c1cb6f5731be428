"""n > 1 or best_of > 1: one user request fans out into independent core requests.

The core only knows n=1 requests, so each sample is its own child (sharing the
prompt, hence its prefix-cached blocks). The parent gathers the children's
`CompletionOutput`s back into one `RequestOutput` for the caller. With best_of > n
(as vLLM): best_of children run, and once all have finished the parent returns the
n with the highest cumulative logprob, best first; nothing is emitted before then,
since a ranking needs every sequence complete.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import msgspec

from vllm_lite.outputs import CompletionOutput
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


class ParentRequest:
    """Tracks the children of an n > 1 request and merges their outputs."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        if params.num_samples < 2:
            raise ValueError(f"ParentRequest needs n >= 2 or best_of >= 2, got n={params.n!r}.")
        self.request_id = request_id
        self.sampling_params = params
        self.n = params.n
        self.num_children = params.num_samples
        # best_of > n: rank the finished children and keep the top n.
        self.ranked = self.num_children > self.n
        self.output_kind = params.output_kind
        self.child_ids = [child_request_id(request_id, i) for i in range(self.num_children)]
        self.unfinished: set[str] = set(self.child_ids)
        # Latest CompletionOutput per child index (CUMULATIVE snapshots / FINAL_ONLY results).
        self._latest: list[Optional[CompletionOutput]] = [None] * self.num_children
        # DELTA outputs received in the current batch, not yet emitted.
        self._pending: dict[int, CompletionOutput] = {}
        # DELTA: the shared prompt's logprobs were already emitted by one child.
        self.prompt_logprobs_sent = False

    @staticmethod
    def make_child_requests(
        request_id: str, params: SamplingParams
    ) -> tuple["ParentRequest", list[tuple[str, SamplingParams]]]:
        """The parent plus (child id, child params) for each sample; pass the already-processed params."""
        parent = ParentRequest(request_id, params)
        return parent, [(parent.child_ids[i], parent.child_params(i)) for i in range(parent.num_children)]

    def child_params(self, index: int) -> SamplingParams:
        """n=1 copy of the params; a seeded request gives each child its own seed so samples differ.

        A ranked child reports its final output only, and at least the sampled token's logprob
        (logprobs=0) so that its cumulative logprob exists to rank by.
        """
        p = self.sampling_params
        seed = (p.seed + index) % (1 << 64) if p.seed is not None else None
        extra: dict = {}
        if self.ranked:
            extra = dict(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=p.logprobs if p.logprobs is not None else 0)
        # replace() re-runs __post_init__ on a copy; the frontend-filled fields ride along.
        return msgspec.structs.replace(p, n=1, best_of=None, seed=seed, **extra)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def add_child_output(self, child_id: str, completion: CompletionOutput) -> None:
        """Record one child's output of this batch (its `index` is the child index)."""
        if completion.finished():
            self.unfinished.discard(child_id)
        if self.output_kind == RequestOutputKind.DELTA and not self.ranked:
            prev = self._pending.get(completion.index)
            self._pending[completion.index] = completion if prev is None else merge_delta(prev, completion)
        else:
            self._latest[completion.index] = completion

    def take_outputs(self) -> Optional[list[CompletionOutput]]:
        """The outputs to emit for this batch, sorted by index, or None when nothing is due.

        FINAL_ONLY: all n once every child finished. CUMULATIVE: the latest snapshot of
        every child heard from. DELTA: the new pieces of the children that moved.
        """
        if self.ranked:
            return self._best_n() if self.finished else None
        if self.output_kind == RequestOutputKind.DELTA:
            if not self._pending:
                return None
            out = [self._pending[i] for i in sorted(self._pending)]
            self._pending = {}
            return out
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        out = [c for c in self._latest if c is not None]
        return out or None

    def _best_n(self) -> Optional[list[CompletionOutput]]:
        """The n finished children with the highest cumulative logprob, re-indexed 0..n-1 best first."""
        done = [c for c in self._latest if c is not None]
        # Stable sort: equal scores keep child order. An aborted child may lack a score: it ranks last.
        done.sort(key=lambda c: c.cumulative_logprob if c.cumulative_logprob is not None else -math.inf, reverse=True)
        keep_logprobs = self.sampling_params.logprobs is not None
        out = [
            dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
            for i, c in enumerate(done[: self.n])
        ]
        return out or None


def merge_delta(prev: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    """Two consecutive DELTA pieces of one sequence as one piece."""
    logprobs = prev.logprobs
    if new.logprobs is not None:
        logprobs = (prev.logprobs or []) + new.logprobs
    return CompletionOutput(
        index=prev.index,
        text=prev.text + new.text,
        token_ids=prev.token_ids + new.token_ids,
        cumulative_logprob=new.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=new.finish_reason,
        stop_reason=new.stop_reason,
    )
