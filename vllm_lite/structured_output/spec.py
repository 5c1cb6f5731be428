"""A request's constraint as a hashable spec: what a backend compiles and the grammar cache's key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from vllm_lite.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint in canonical text form (JSON schemas re-serialized compactly, choices as a JSON list).

    Keys keep the schema's order: properties are generated in the order the schema lists them, as vLLM does.
    """

    kind: str  # json, regex, choice, grammar, json_object, structural_tag
    text: str
    any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    @property
    def field(self) -> str:
        """The user-visible field this constraint came from, for error messages."""
        return f"structured_outputs.{self.kind}"


def spec_from_params(
    params: StructuredOutputsParams, disable_any_whitespace: bool = False, disable_additional_properties: bool = False
) -> GrammarSpec:
    """The spec for `params`; the engine-wide flags are OR-ed with the request's own. Raises ValueError on bad JSON."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}.")
        text = json.dumps(schema, ensure_ascii=False)
    elif kind == "choice":
        text = json.dumps(params.choice, ensure_ascii=False)
    elif kind == "json_object":
        text = '{"type": "object"}'
    else:
        text = getattr(params, kind)
    return GrammarSpec(
        kind=kind,
        text=text,
        any_whitespace=not (disable_any_whitespace or params.disable_any_whitespace),
        disable_additional_properties=disable_additional_properties or params.disable_additional_properties,
        whitespace_pattern=params.whitespace_pattern,
    )


def legacy_structural_tag(text: str) -> Optional[tuple[list[dict], list[str]]]:
    """(structures, triggers) of vLLM's original structural_tag JSON ({"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}), or None for another form (xgrammar's {"type": ..., "format": ...})."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if not isinstance(data, dict) or "structures" not in data or "format" in data:
        return None
    structures, triggers = data.get("structures"), data.get("triggers", [])
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise ValueError("structured_outputs.structural_tag: structures and triggers must be lists.")
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
            raise ValueError(
                f"structured_outputs.structural_tag: each structure needs begin, schema and end, got {s!r}."
            )
    return structures, triggers
