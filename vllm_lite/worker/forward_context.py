"""Per-step state that attention layers read during one forward pass.

The model code stays a plain nn.Module taking (input_ids, positions); the
runner sets the step's attention metadata and backend around the call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

from vllm_lite.worker.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    backend: AttentionBackend


_CONTEXT: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("Attention ran outside set_forward_context(): the runner must set step metadata.")
    return _CONTEXT


def current_forward_context() -> Optional[ForwardContext]:
    """The step's context, or None outside set_forward_context() (callers that have another way to go)."""
    return _CONTEXT


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata, backend: AttentionBackend) -> Iterator[None]:
    global _CONTEXT
    prev = _CONTEXT
    _CONTEXT = ForwardContext(metadata, backend)
    try:
        yield
    finally:
        _CONTEXT = prev
