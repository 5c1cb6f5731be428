"""Speculative decoding counters, as vLLM's SpecDecodingStats: one per scheduler step, summed by the frontend.

The Prometheus names they feed are vLLM's (`METRIC_NAMES`); the per-position counter is labelled by position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


@dataclass
class SpecDecodingStats:
    """Drafts verified, draft tokens proposed and accepted, and acceptances by draft position."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens!r}.")
        return cls(num_spec_tokens=num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified proposal: it proposed `num_draft_tokens`, the first `num_accepted_tokens` held."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"need 0 <= num_accepted_tokens ({num_accepted_tokens!r}) <= num_draft_tokens "
                f"({num_draft_tokens!r}) <= num_spec_tokens ({self.num_spec_tokens!r})."
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def observe_batch(self, num_draft_tokens: np.ndarray, num_accepted_tokens: np.ndarray) -> None:
        """A step's verified proposals at once (rows with no draft tokens are not drafts and are skipped)."""
        drafts = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
        accepted = np.asarray(num_accepted_tokens, dtype=np.int64).reshape(-1)
        if drafts.shape != accepted.shape:
            raise ValueError(f"need one accepted count per draft, got {drafts.shape} and {accepted.shape}.")
        keep = drafts > 0
        drafts, accepted = drafts[keep], accepted[keep]
        if len(drafts) and (accepted.min() < 0 or (accepted > drafts).any() or drafts.max() > self.num_spec_tokens):
            raise ValueError(
                f"need 0 <= accepted <= drafts <= {self.num_spec_tokens}, got {drafts!r} and {accepted!r}."
            )
        self.num_drafts += len(drafts)
        self.num_draft_tokens += int(drafts.sum())
        self.num_accepted_tokens += int(accepted.sum())
        per_pos = (np.arange(self.num_spec_tokens)[None, :] < accepted[:, None]).sum(axis=0)
        self.num_accepted_tokens_per_pos = [a + int(c) for a, c in zip(self.num_accepted_tokens_per_pos, per_pos)]

    def merge(self, other: SpecDecodingStats) -> None:
        """Add another step's counters (the frontend's running totals)."""
        if other.num_spec_tokens != self.num_spec_tokens:
            raise ValueError(f"num_spec_tokens differ: {self.num_spec_tokens!r} vs {other.num_spec_tokens!r}.")
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_accepted_tokens_per_pos = [
            a + b for a, b in zip(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos)
        ]

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: the accepted ones plus the bonus/recovered one (as vLLM logs it)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Fraction of drafts whose token at each position was accepted."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.num_accepted_tokens_per_pos]

    def counters(self) -> dict[str, int | list[int]]:
        """vLLM metric name -> value (the per-position counter as a list indexed by position)."""
        return {
            METRIC_NAMES["num_drafts"]: self.num_drafts,
            METRIC_NAMES["num_draft_tokens"]: self.num_draft_tokens,
            METRIC_NAMES["num_accepted_tokens"]: self.num_accepted_tokens,
            METRIC_NAMES["num_accepted_tokens_per_pos"]: list(self.num_accepted_tokens_per_pos),
        }

    def log_message(self, interval_s: float) -> str:
        """The periodic structured log line (vLLM's "SpecDecoding metrics"), over an interval of `interval_s`."""
        dt = max(interval_s, 1e-9)
        per_pos = ",".join(f"{r:.3f}" for r in self.acceptance_rate_per_pos)
        return (
            f"SpecDecoding metrics: mean_acceptance_length={self.mean_acceptance_length:.2f} "
            f"accepted_tput={self.num_accepted_tokens / dt:.1f} tok/s drafted_tput={self.num_draft_tokens / dt:.1f} "
            f"tok/s accepted={self.num_accepted_tokens} drafted={self.num_draft_tokens} drafts={self.num_drafts} "
            f"draft_acceptance_rate={100 * self.draft_acceptance_rate:.1f}% per_position_acceptance_rate=[{per_pos}]"
        )
