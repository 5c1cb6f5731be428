"""Llama 3.x JSON tool calls: the reply is `{"name": .., "parameters": {..}}` (optionally after
`<|python_tag|>`), several separated by `;`. A reply that does not start with `{` is plain content.
"""

from __future__ import annotations

from vllm_lite.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolParser, call_from_object
from vllm_lite.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_object, skip_ws
from vllm_lite.entrypoints.openai.tool_parsers.registry import ToolParserManager

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return ParsedOutput("")  # nothing yet, or the start of the tag
        if start >= len(text):
            return ParsedOutput(text if final else "")
        if text[start] != "{":
            return ParsedOutput(text)
        out = ParsedOutput("")
        try:
            pos = start
            while True:
                scan = scan_object(text, pos)
                out.calls.append(call_from_object(text, scan, argument_keys=_ARGUMENT_KEYS))
                if scan.end is None:
                    break
                pos = skip_ws(text, scan.end)
                if pos >= len(text):
                    break
                if text[pos] != ";":
                    raise MalformedJSON(f"expected ';' between calls at {pos}")
                pos = skip_ws(text, pos + 1)
                if pos >= len(text):
                    break
        except MalformedJSON:
            return ParsedOutput(text, malformed=True)
        return out
