"""Constraints for structured-output tests and benchmarks: JSON schemas, regexes, choice lists, one grammar.

Random-weight models wander, so every constraint here must be *finishable* by a model that picks tokens
arbitrarily among the allowed ones: strings carry a maxLength (or a bounded pattern), arrays a maxItems,
objects `additionalProperties: false`, numbers bounds. Each case names the JSON-schema feature it exercises;
`check_output` says whether a generated text satisfies its constraint (jsonschema for schemas, `re.fullmatch`
for regexes, set membership for choices, `parse_arithmetic` for the grammar).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class ConstraintCase:
    """One named constraint: `kind` is a `StructuredOutputsParams` field name, `spec` its value."""

    name: str
    kind: str  # "json" | "regex" | "choice" | "grammar"
    spec: Union[dict[str, Any], str, list[str]]
    # Backends on which a random model surely finishes it valid. Bounded floats: xgrammar caps the fraction at
    # 6 digits but ignores multipleOf; llguidance honours multipleOf but lets fraction digits run on. Strings
    # with maxLength: xgrammar lets control characters through (see _SHORT).
    backends: tuple[str, ...] = ("xgrammar", "guidance")


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A closed object schema (no extra keys: a random model could otherwise add keys forever)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


# Short strings by pattern: xgrammar 0.2.8 builds maxLength strings from [^"\\\r\n], which lets raw control
# characters (invalid JSON) through; a pattern keeps both backends to valid characters.
_SHORT = {"type": "string", "pattern": "^[a-z ]{0,6}$"}
_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}

JSON_SCHEMAS: list[ConstraintCase] = [
    ConstraintCase(
        "flat_required", "json", _obj({"name": _SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}})
    ),
    ConstraintCase("optional_fields", "json", _obj({"id": _DIGIT, "note": _SHORT, "ok": {"type": "boolean"}}, ["id"])),
    ConstraintCase("enum_strings", "json", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ConstraintCase("enum_mixed", "json", {"enum": ["on", "off", 1, 0, None, True]}),
    ConstraintCase("const_field", "json", _obj({"kind": {"const": "point"}, "v": _DIGIT})),
    ConstraintCase("boolean", "json", _obj({"active": {"type": "boolean"}, "admin": {"type": "boolean"}})),
    ConstraintCase("null", "json", _obj({"nothing": {"type": "null"}})),
    ConstraintCase(
        "nullable_type_list", "json", _obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}})
    ),
    ConstraintCase("integer_bounds", "json", {"type": "integer", "minimum": -40, "maximum": 40}),
    ConstraintCase(
        "integer_exclusive_bounds",
        "json",
        _obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    ),
    ConstraintCase(
        "float_bounds", "json", _obj({"x": {"type": "number", "minimum": 0.5, "maximum": 9.5}}), ("xgrammar",)
    ),
    ConstraintCase(
        "negative_float_bounds", "json", {"type": "number", "minimum": -2.5, "maximum": -0.5}, ("xgrammar",)
    ),
    ConstraintCase(
        "float_bounds_multiple_of",
        "json",
        _obj({"x": {"type": "number", "minimum": 0.5, "maximum": 9.5, "multipleOf": 0.25}}),
        ("guidance",),
    ),
    ConstraintCase(
        "negative_float_multiple_of",
        "json",
        {"type": "number", "minimum": -2.5, "maximum": -0.5, "multipleOf": 0.5},
        ("guidance",),
    ),
    ConstraintCase("string_pattern", "json", _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}})),
    ConstraintCase(
        "string_lengths", "json", _obj({"word": {"type": "string", "minLength": 2, "maxLength": 5}}), ("guidance",)
    ),
    ConstraintCase("array_min_max_items", "json", {"type": "array", "items": _DIGIT, "minItems": 2, "maxItems": 4}),
    ConstraintCase(
        "array_of_objects",
        "json",
        _obj(
            {
                "items": {
                    "type": "array",
                    "items": _obj({"id": _DIGIT, "tag": {"enum": ["a", "b"]}}),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
    ConstraintCase(
        "nested_arrays",
        "json",
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
            "minItems": 1,
            "maxItems": 2,
        },
    ),
    ConstraintCase(
        "nested_objects",
        "json",
        _obj(
            {
                "user": _obj(
                    {
                        "name": _SHORT,
                        "address": _obj({"city": _SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                    }
                )
            }
        ),
    ),
    ConstraintCase(
        "ref_defs",
        "json",
        {
            "$defs": {"point": _obj({"x": _DIGIT, "y": _DIGIT})},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
    ),
    ConstraintCase(
        "ref_array_items",
        "json",
        {
            "$defs": {"tag": {"type": "string", "enum": ["x", "y", "z"]}},
            **_obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3}}),
        },
    ),
    ConstraintCase(
        "any_of",
        "json",
        _obj({"value": {"anyOf": [_DIGIT, {"type": "string", "pattern": "^[a-z]{1,3}$"}, {"type": "null"}]}}),
    ),
    ConstraintCase(
        "any_of_objects",
        "json",
        {
            "anyOf": [
                _obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
                _obj({"square": {"type": "integer", "minimum": 1, "maximum": 9}}),
            ]
        },
    ),
    ConstraintCase(
        "everything",
        "json",
        {
            "$defs": {"size": {"enum": ["S", "M", "L"]}},
            **_obj(
                {
                    "sku": {"type": "string", "pattern": "^[a-z]{3}[0-9]$"},
                    "price": {"type": "integer", "minimum": 0, "maximum": 100},
                    "sizes": {"type": "array", "items": {"$ref": "#/$defs/size"}, "minItems": 1, "maxItems": 3},
                    "stock": {"type": "integer", "minimum": 0, "maximum": 999},
                    "gift": {"type": "boolean"},
                    "extra": {"type": "null"},
                },
                ["sku", "price", "sizes"],
            ),
        },
    ),
]

REGEXES: list[ConstraintCase] = [
    ConstraintCase("ipv4", "regex", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    ConstraintCase("date", "regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ConstraintCase("word_list", "regex", r"[a-z]{1,6}(, [a-z]{1,6}){0,2}\."),
    ConstraintCase("hex_color", "regex", r"#[0-9a-fA-F]{6}"),
]

CHOICES: list[ConstraintCase] = [
    ConstraintCase("sentiment", "choice", ["positive", "negative", "neutral"]),
    ConstraintCase("yes_no", "choice", ["yes", "no"]),
    ConstraintCase("prefixes", "choice", ["for", "for statement", "while", "with"]),
]

# Arithmetic over small numbers with at most one level of parentheses: bounded, so a random walk ends.
# xgrammar takes EBNF (GBNF); llguidance takes Lark (and converts GBNF itself).
GRAMMAR_EBNF = r"""root ::= expr
expr ::= term | term op term | term op term op term
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= "0" | [1-9] | [1-9] [0-9]
"""
GRAMMAR_LARK = r"""start: expr
expr: term | term OP term | term OP term OP term
term: NUM | "(" NUM OP NUM ")"
OP: "+" | "-" | "*"
NUM: /0|[1-9][0-9]?/
"""
GRAMMARS: dict[str, ConstraintCase] = {
    "ebnf": ConstraintCase("arithmetic_ebnf", "grammar", GRAMMAR_EBNF),
    "lark": ConstraintCase("arithmetic_lark", "grammar", GRAMMAR_LARK),
}


class _Arith:
    """Recursive-descent parser for the arithmetic grammar above (no regex shortcut: it checks the structure)."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _expect(self, ch: str) -> None:
        if self._peek() != ch:
            raise ValueError(f"expected {ch!r} at {self.pos} in {self.text!r}")
        self.pos += 1

    def num(self) -> int:
        start = self.pos
        if self._peek() == "0":
            self.pos += 1
        elif self._peek() and self._peek() in "123456789":
            self.pos += 1
            if self._peek() and self._peek() in "0123456789":
                self.pos += 1
        else:
            raise ValueError(f"expected a number at {start} in {self.text!r}")
        return int(self.text[start : self.pos])

    def op(self) -> str:
        ch = self._peek()
        if not ch or ch not in "+-*":
            raise ValueError(f"expected an operator at {self.pos} in {self.text!r}")
        self.pos += 1
        return ch

    def term(self) -> int:
        if self._peek() != "(":
            return self.num()
        self._expect("(")
        value = _apply(self.num(), self.op(), self.num())
        self._expect(")")
        return value

    def expr(self) -> int:
        terms, ops = [self.term()], []
        while self._peek() and self._peek() in "+-*" and len(ops) < 2:
            ops.append(self.op())
            terms.append(self.term())
        value = terms[0]
        for o, t in zip(ops, terms[1:]):
            value = _apply(value, o, t)  # left to right: the grammar gives no precedence
        if self.pos != len(self.text):
            raise ValueError(f"trailing text at {self.pos} in {self.text!r}")
        return value


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def parse_arithmetic(text: str) -> int:
    """Parse a sentence of the arithmetic grammar (raises ValueError if it is not one) and evaluate it."""
    return _Arith(text).expr()


def check_output(case: ConstraintCase, text: str) -> None:
    """Raise AssertionError (with the text) unless `text` satisfies `case`'s constraint."""
    import jsonschema

    if case.kind == "json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise AssertionError(f"{case.name}: not JSON ({e}): {text!r}") from e
        try:
            jsonschema.validate(value, case.spec)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{case.name}: {e.message}: {text!r}") from e
    elif case.kind == "regex":
        assert re.fullmatch(str(case.spec), text), f"{case.name}: {text!r} does not match {case.spec!r}"
    elif case.kind == "choice":
        assert text in case.spec, f"{case.name}: {text!r} is not one of {case.spec!r}"
    elif case.kind == "grammar":
        try:
            parse_arithmetic(text)
        except ValueError as e:
            raise AssertionError(f"{case.name}: {e}") from e
    else:
        raise ValueError(f"unknown constraint kind {case.kind!r}")


def cases_for(backend: str) -> list[ConstraintCase]:
    """Every schema, regex and choice case a random model finishes on `backend`, plus the grammar in the
    format that backend takes (EBNF for xgrammar, Lark for guidance)."""
    grammar = GRAMMARS["ebnf" if backend == "xgrammar" else "lark"]
    return [c for c in (*JSON_SCHEMAS, *REGEXES, *CHOICES) if backend in c.backends] + [grammar]
