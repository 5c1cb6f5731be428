"""The interface every grammar backend implements: compile a spec once, then one matcher per request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from vllm_lite.structured_output.spec import GrammarSpec


class GrammarCompileError(ValueError):
    """A constraint the backend cannot compile; the message is the compiler's own."""


class StructuredOutputMatcher(ABC):
    """One request's position in its grammar: advanced on accepted tokens, rolled back on un-done ones."""

    def __init__(self) -> None:
        # Tokens accepted so far (and not rolled back): lets the core check it is in sync with the request.
        self.num_accepted_tokens = 0

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over `token_ids`; False (state unchanged past the first rejected token) if one is not allowed."""

    def rollback(self, num_tokens: int) -> None:
        """Un-accept the last `num_tokens` accepted tokens (preemption, rejected speculative tokens)."""
        if num_tokens < 0 or num_tokens > self.num_accepted_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted_tokens} accepted.")
        if num_tokens:
            self._rollback(num_tokens)
            self.num_accepted_tokens -= num_tokens

    @abstractmethod
    def _rollback(self, num_tokens: int) -> None:
        """The backend's own rollback of `num_tokens` (already checked against what was accepted)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into int32 `bitmask[row]` (bit t%32 of word t//32 set = allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar can accept nothing more (it accepted a stop token, or it is complete)."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the grammar's start, as a fresh matcher."""

    @classmethod
    def fill_bitmask_batch(cls, rows: Sequence[tuple["StructuredOutputMatcher", int]], bitmask: torch.Tensor) -> None:
        """Fill several rows at once (a backend may do it in parallel); all matchers are of this class."""
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask, row)

    def resync(self, token_ids: Sequence[int]) -> bool:
        """Make the matcher have accepted exactly `token_ids` (reset + re-accept unless already in sync)."""
        if self.num_accepted_tokens == len(token_ids):
            return True
        self.reset()
        return self.accept_tokens(token_ids)


class StructuredOutputBackend(ABC):
    """Compiles `GrammarSpec`s against one tokenizer; compiled grammars are shareable between requests."""

    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """A compiled grammar (opaque, cacheable, thread-safe to share); raises GrammarCompileError."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> StructuredOutputMatcher:
        """A fresh matcher at the start of `compiled`."""
