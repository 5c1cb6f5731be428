"""A scope with torch's intra-op thread count set, for tests that check a kernel's result does not depend on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch.set_num_threads(n) inside the block; the count from before is restored on leaving it, raised or not."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(before)
