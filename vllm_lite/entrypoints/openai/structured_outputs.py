"""Request fields -> `SamplingParams.structured_outputs`, as vLLM's OpenAI server converts them.

Three spellings ask for one constraint: OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` (with `guided_whitespace_pattern`). Tool calling adds a
fourth (tool_choice named or "required"). A request may use one; two are a 400 naming both.
What only the grammar compiler can judge (a schema it cannot compile, a bad regex) is checked
by the engine's processor before the request is queued, and comes back as a 400 with its message.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from vllm_lite.entrypoints.openai.errors import BadRequestError
from vllm_lite.sampling_params import StructuredOutputsParams

# (field that asked for it, StructuredOutputsParams keyword arguments)
Constraint = tuple[str, dict[str, Any]]

_GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def request_constraints(request: Any) -> list[Constraint]:
    """Every constraint the request's structured-output fields ask for, in field order."""
    found: list[Constraint] = []
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise BadRequestError(
                "response_format of type json_schema needs json_schema.schema (the JSON schema).",
                param="response_format",
            )
        found.append(("response_format", {"json": _schema(fmt.json_schema.json_schema, "response_format")}))
    so = getattr(request, "structured_outputs", None)
    if so is not None:
        kwargs = so.model_dump(exclude_none=True)
        if "json_schema" in kwargs:
            kwargs["json"] = _schema(kwargs.pop("json_schema"), "structured_outputs")
        found.append(("structured_outputs", kwargs))
    for field, key in _GUIDED:
        value = getattr(request, field, None)
        if value is None:
            continue
        if key == "json":
            value = _schema(value, field)
        if key == "choice" and not value:
            raise BadRequestError(f"{field} must not be empty: give at least one choice.", param=field)
        found.append((field, {key: value}))
    return found


def build_structured_outputs(
    request: Any, extra: Optional[Constraint] = None
) -> Optional[tuple[str, StructuredOutputsParams]]:
    """(the field it came from, the constraint) for this request (`extra`: the tool-calling one), or None."""
    found = request_constraints(request)
    if extra is not None:
        found.append(extra)
    whitespace = getattr(request, "guided_whitespace_pattern", None)
    if len(found) > 1:
        names = [f for f, _ in found]
        raise BadRequestError(
            f"{' and '.join(names)} each constrain the output; a request may use only one of them.", param=names[1]
        )
    if not found:
        if whitespace is not None:
            raise BadRequestError(
                "guided_whitespace_pattern applies to a JSON constraint (guided_json, response_format); none was given.",
                param="guided_whitespace_pattern",
            )
        return None
    field, kwargs = found[0]
    if whitespace is not None:
        kwargs = {**kwargs, "whitespace_pattern": whitespace}
    try:
        return field, StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise BadRequestError(str(e), param=field) from e


def _schema(value: Any, field: str) -> Any:
    """A JSON schema as StructuredOutputsParams takes it: an object, or JSON text that parses."""
    if isinstance(value, bool):
        return json.dumps(value)  # true: any JSON value; false: none
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise BadRequestError(f"{field}: the JSON schema is not valid JSON: {e}", param=field) from None
        if not isinstance(parsed, (dict, bool)):
            raise BadRequestError(f"{field}: a JSON schema must be an object, got {parsed!r}.", param=field)
        return value
    if not isinstance(value, dict):
        raise BadRequestError(f"{field}: a JSON schema must be an object, got {value!r}.", param=field)
    return value
