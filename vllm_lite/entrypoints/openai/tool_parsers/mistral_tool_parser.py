"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of `{"name": .., "arguments": {..}}`.

Content is the text before the marker; without the marker the reply is plain content.
"""

from __future__ import annotations

from vllm_lite.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolParser
from vllm_lite.entrypoints.openai.tool_parsers.forced import scan_call_array
from vllm_lite.entrypoints.openai.tool_parsers.hermes_tool_parser import held_back
from vllm_lite.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, skip_ws
from vllm_lite.entrypoints.openai.tool_parsers.registry import ToolParserManager

BOT = "[TOOL_CALLS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    name = "mistral"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(BOT)
        if first < 0:
            keep = 0 if final else held_back(text, BOT)
            return ParsedOutput(text[: len(text) - keep])
        start = skip_ws(text, first + len(BOT))
        if start >= len(text):
            return ParsedOutput(text[:first])
        try:
            return ParsedOutput(text[:first], scan_call_array(text, start, ("arguments",)))
        except MalformedJSON:
            return ParsedOutput(text, malformed=True)
