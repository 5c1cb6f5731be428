"""Loading the tokenizer that belongs to a checkpoint (local directories only)."""

from __future__ import annotations

import os
from typing import Any


def get_tokenizer(path: str) -> Any:
    """AutoTokenizer from a local directory, with a clear error when there is none."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Tokenizer directory {path!r} does not exist (no model hub here: pass a local path).")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"Could not load a tokenizer from {path!r}: {e}") from e
