"""A tokenizer with one token per character (id = code point), for frontend unit tests that need no BPE.

Expected texts are then plain strings: `ids("abc")` decodes to "abc". Id 0 is the only special token;
ids past Unicode have no token, and decoding them raises, as an unknown id does in a real tokenizer.
It goes through the detokenizer's slow (non-Rust) path.
"""

from __future__ import annotations

from typing import Optional

MAX_ID = 0x10FFFF


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


class CharTokenizer:
    all_special_ids = [0]
    added_tokens_decoder: dict[int, str] = {}
    eos_token_id = 0

    def convert_ids_to_tokens(self, token_id: int) -> Optional[str]:
        return chr(token_id) if 0 <= token_id <= MAX_ID else None

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if any(not 0 <= i <= MAX_ID for i in token_ids):
            raise ValueError(f"unknown token id in {token_ids!r}")
        return "".join(chr(i) for i in token_ids if not (skip_special_tokens and i in self.all_special_ids))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ids(text)
