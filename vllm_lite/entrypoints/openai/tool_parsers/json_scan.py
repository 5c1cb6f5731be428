"""A scanner for JSON that is still being generated: where values start and end, no decoding.

Tool calls stream: the server must know, from a prefix of the model's text, whether a call's
`name` is complete and how much of its `arguments` has arrived. `json.loads` needs the whole
text, so this reads structure only (strings, brackets, scalars) and reports spans; finished
pieces are decoded with `json.loads`. Malformed input raises `MalformedJSON`; a prefix that may
still become valid JSON is reported as incomplete (an end of None).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

_WS = " \t\n\r"
_SCALAR = set("-+.0123456789eEtrufalsn")


class MalformedJSON(ValueError):
    """The text cannot be the start of the JSON expected here."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> Optional[int]:
    """End (exclusive) of the string starting at text[i] == '"', or None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> Optional[int]:
    """End (exclusive) of the JSON value starting at text[i], or None if the text ends first."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        stack = [c]
        j = i + 1
        while j < len(text):
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if stack.pop() != ("{" if c == "}" else "["):
                    raise MalformedJSON(f"mismatched {c!r} at {j}")
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] in _SCALAR:
        j += 1
    if j == i:
        raise MalformedJSON(f"no JSON value at {i}: {text[i : i + 10]!r}")
    return None if j == len(text) else j  # a number at the very end may still grow


@dataclass
class FieldSpan:
    start: int  # where the value starts
    end: Optional[int]  # exclusive; None: not finished yet


@dataclass
class ObjectScan:
    fields: dict[str, FieldSpan] = field(default_factory=dict)
    end: Optional[int] = None  # exclusive end of the object; None: not closed yet


def scan_object(text: str, i: int) -> ObjectScan:
    """The top-level fields of the object starting at text[i] == '{', as far as the text goes."""
    if i >= len(text) or text[i] != "{":
        raise MalformedJSON(f"expected '{{' at {i}")
    out = ObjectScan()
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        out.end = j + 1
        return out
    while j < len(text):
        if text[j] != '"':
            raise MalformedJSON(f"expected a key at {j}")
        kend = scan_string(text, j)
        if kend is None:
            return out
        try:
            key = json.loads(text[j:kend])
        except ValueError as e:
            raise MalformedJSON(str(e)) from None
        j = skip_ws(text, kend)
        if j >= len(text):
            return out
        if text[j] != ":":
            raise MalformedJSON(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return out
        vend = scan_value(text, j)
        out.fields[key] = FieldSpan(j, vend)
        if vend is None:
            return out
        j = skip_ws(text, vend)
        if j >= len(text):
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] != ",":
            raise MalformedJSON(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return out
