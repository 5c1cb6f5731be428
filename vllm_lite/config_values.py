"""One reading of the JSON-object options (--structured-outputs-config, --speculative-config, --pooler-config).

Each option takes a dict, its JSON text, or None; unknown keys are refused by name, as vLLM's do."""

from __future__ import annotations

import json
from typing import Any, Iterable


def config_fields(value: Any, option: str, known: Iterable[str]) -> dict[str, Any]:
    """``value`` (a dict or the JSON text of an object) as a dict of ``known`` keys; ValueError naming ``option``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{option} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a dict or JSON object, got {value!r}.")
    known = set(known)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{option}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
    return value
