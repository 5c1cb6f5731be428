"""Token types of a cross-encoder's text pair, compressed to one int for the core (vLLM's
`compressed_token_type_ids`).

A BERT tokenizer marks a pair `[CLS] A [SEP] B [SEP]` as type 0 up to the first [SEP] and type 1 after it.
The engine carries only the index where type 1 begins (the prompt's length when none does); the runner
rebuilds the per-token types from it. A tokenizer whose types are not one 0s-then-1s split cannot be
carried this way and is refused rather than run with wrong types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional


def compress_token_type_ids(token_type_ids: Sequence[int]) -> int:
    """The index of the first type-1 token (len when none); ValueError unless all 0s then all 1s."""
    types = list(token_type_ids)
    if any(t not in (0, 1) or isinstance(t, bool) for t in types):
        raise ValueError(f"token_type_ids must hold only 0 and 1, got {sorted(set(map(repr, types)))}.")
    boundary = types.index(1) if 1 in types else len(types)
    if any(t != 1 for t in types[boundary:]):
        raise ValueError(
            "token_type_ids must be 0s followed by 1s (one text pair, the second text typed 1); this tokenizer's "
            f"pair encoding is not one contiguous split: {types}."
        )
    return boundary


def encode_pair(tokenizer: Any, text_1: str, text_2: str) -> dict[str, Any]:
    """A token prompt for the pair as the tokenizer encodes it, with its `token_type_ids` when it returns them."""
    enc = tokenizer(text_1, text_2)
    prompt: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
    types = enc.get("token_type_ids")
    if types is not None:
        prompt["token_type_ids"] = list(types)
    return prompt


def prompt_token_type_boundary(prompt: Any, num_tokens: int, is_pooling: bool) -> Optional[int]:
    """The compressed token types of a dict prompt that carries `token_type_ids` (None when it has none)."""
    if not isinstance(prompt, dict) or prompt.get("token_type_ids") is None:
        return None
    types = prompt["token_type_ids"]
    if not is_pooling:
        raise ValueError("token_type_ids apply to pooling requests (cross-encoders) only, not to generation.")
    if not isinstance(types, (list, tuple)) or len(types) != num_tokens:
        got = len(types) if isinstance(types, (list, tuple)) else type(types).__name__
        raise ValueError(f"token_type_ids must be a list with one type per prompt token ({num_tokens}), got {got}.")
    return compress_token_type_ids(types)
