"""JSON-schema keywords that xgrammar accepts but does not enforce (or enforces wrongly), found by walking a schema.

xgrammar 0.2 compiles `multipleOf` with only a warning, and its length-bounded strings (`minLength`/
`maxLength`) let raw control characters through, which is not valid JSON. Under `auto` such schemas go to
llguidance, which enforces them; with `backend="xgrammar"` they are refused, as vLLM does, rather than run
to outputs that break the schema.
"""

from __future__ import annotations

from typing import Any

# keyword -> the JSON types it applies to (None: any).
_XGRAMMAR_UNENFORCED: dict[str, tuple[str, ...]] = {
    "multipleOf": ("number", "integer"),
    "minLength": ("string",),
    "maxLength": ("string",),
    "uniqueItems": ("array",),
    "contains": ("array",),
    "minContains": ("array",),
    "maxContains": ("array",),
    "patternProperties": ("object",),
    "propertyNames": ("object",),
}


def xgrammar_unsupported_features(schema: Any) -> list[str]:
    """Sorted keywords in `schema` (anywhere in it) that xgrammar would not enforce; empty when it is safe."""
    found: set[str] = set()
    _walk(schema, found)
    return sorted(found)


def _walk(node: Any, found: set[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item, found)
        return
    if not isinstance(node, dict):
        return
    for keyword in _XGRAMMAR_UNENFORCED:
        if keyword in node and not (keyword == "uniqueItems" and node[keyword] is False):
            found.add(keyword)
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # data, not schema
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            for sub in value.values():
                _walk(sub, found)
        else:
            _walk(value, found)
