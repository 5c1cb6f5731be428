"""What a chat request's `tools` and `tool_choice` ask of the server, decided before it is generated.

- "none" (or no tools): plain content; the tools still reach the chat template, as in vLLM.
- "auto" (OpenAI's default when tools are given): the server's tool-call parser reads the reply
  (`--enable-auto-tool-choice --tool-call-parser NAME`); without them it is a 400, as in vLLM.
- a named function: the output is constrained to that function's parameters schema.
- "required": the output is constrained to vLLM's array of one or more {name, parameters} objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vllm_lite.entrypoints.openai.errors import BadRequestError
from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionToolsParam
from vllm_lite.entrypoints.openai.structured_outputs import Constraint
from vllm_lite.entrypoints.openai.tool_parsers import NamedToolCallParser, RequiredToolCallsParser, ToolParser

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    tools: Optional[list[dict[str, Any]]]  # for the chat template
    constraint: Optional[Constraint]  # named / required: the JSON-schema constraint
    parser: Optional[ToolParser]  # how to read tool calls out of the reply (None: plain content)


def plan_tools(request: ChatCompletionRequest, auto_tool_parser: Optional[ToolParser]) -> ToolPlan:
    """The plan for this request; `auto_tool_parser` is the server's --tool-call-parser (None: auto is off)."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadRequestError("tool_choice names a tool or requires one, but no tools were given.", param="tools")
        return ToolPlan(None, None, None)
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are present
    if choice == "none":
        return ToolPlan(tool_dicts, None, None)
    if choice == "auto":
        if auto_tool_parser is None:
            raise BadRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                param="tool_choice",
            )
        return ToolPlan(tool_dicts, None, auto_tool_parser)
    if choice == "required":
        return ToolPlan(tool_dicts, ("tool_choice", {"json": required_schema(tools)}), RequiredToolCallsParser())
    name = choice.function.name
    match = next((t for t in tools if t.function.name == name), None)
    if match is None:
        raise BadRequestError(f"tool_choice names function {name!r}, which is not in tools.", param="tool_choice")
    schema = match.function.parameters or dict(_EMPTY_PARAMETERS)
    return ToolPlan(tool_dicts, ("tool_choice", {"json": schema}), NamedToolCallParser(name))


def required_schema(tools: list[ChatCompletionToolsParam]) -> dict[str, Any]:
    """vLLM's schema for tool_choice="required": an array of >= 1 calls, each {name, parameters} of one tool.

    Each tool's `$defs` move to the top level, where its `#/$defs/...` references point.
    """
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        params = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise BadRequestError(
                    f"tools define $defs/{key} differently; tool_choice=required needs them to agree.", param="tools"
                )
            defs[key] = value
        alternatives.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if defs:
        schema["$defs"] = defs
    return schema
