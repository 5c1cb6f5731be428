"""Tool calls the request forces through a JSON-schema constraint (tool_choice named or "required").

Named: the whole output is that function's arguments object. Required: the output is vLLM's array
`[{"name": .., "parameters": {..}}, ...]` (tool_choice.py builds its schema).
"""

from __future__ import annotations

from vllm_lite.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCall,
    ExtractedToolCallInformation,
    ParsedOutput,
    PartialCall,
    ToolParser,
    call_from_object,
)
from vllm_lite.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_object, skip_ws


def scan_call_array(text: str, start: int, argument_keys: tuple[str, ...]) -> list[PartialCall]:
    """Calls in a JSON array of `{"name": .., <argument key>: {..}}` objects starting at text[start] == '['."""
    if text[start] != "[":
        raise MalformedJSON(f"expected '[' at {start}")
    calls: list[PartialCall] = []
    pos = skip_ws(text, start + 1)
    while pos < len(text):
        if text[pos] == "]" and not calls:
            return calls
        scan = scan_object(text, pos)
        calls.append(call_from_object(text, scan, argument_keys=argument_keys))
        if scan.end is None:
            return calls
        pos = skip_ws(text, scan.end)
        if pos >= len(text) or text[pos] == "]":
            return calls
        if text[pos] != ",":
            raise MalformedJSON(f"expected ',' or ']' at {pos}")
        pos = skip_ws(text, pos + 1)
    return calls


class NamedToolCallParser(ToolParser):
    """tool_choice {"type": "function", "function": {"name": N}}: the output is N's arguments."""

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [PartialCall(self.function_name, text, final)])

    def extract_tool_calls(self, text: str) -> ExtractedToolCallInformation:
        # As vLLM: the call is returned even when max_tokens cut its arguments short.
        return ExtractedToolCallInformation(True, [ExtractedToolCall(self.function_name, text)], None)


class RequiredToolCallsParser(ToolParser):
    """tool_choice "required": an array of one or more {name, parameters} objects."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        if start >= len(text):
            return ParsedOutput("")
        try:
            return ParsedOutput("", scan_call_array(text, start, ("parameters",)))
        except MalformedJSON:
            return ParsedOutput(text, malformed=True)
