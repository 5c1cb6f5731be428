"""How English-like generated text is: the share of its words found in the default model's training text."""

from __future__ import annotations

import re

from vllm_lite.default_model import default_model_path


def known_words() -> set[str]:
    """Words of the training text: pydoc topics plus whole-word tokens of the model's BPE vocabulary."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    words = {w.lower() for text in topics.values() for w in re.findall(r"[A-Za-z]+", text)}
    tok = AutoTokenizer.from_pretrained(default_model_path())
    for piece in tok.get_vocab():
        if piece.startswith("Ġ") and piece[1:].isalpha():
            words.add(piece[1:].lower())
    return words


def english_fraction(text: str, known: set[str]) -> float:
    words = [re.sub(r"[^A-Za-z]", "", w).lower() for w in text.split()]
    words = [w for w in words if w]
    return sum(w in known for w in words) / max(1, len(words))
