"""Hermes-style tool calls (Hermes 2 Pro/3, Qwen 2.5/3): `<tool_call>{"name": .., "arguments": {..}}</tool_call>`.

Content is the text before the first call. A body that is not such an object makes the whole
output plain content, as vLLM's hermes parser answers malformed calls.
"""

from __future__ import annotations

from vllm_lite.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolParser, call_from_object
from vllm_lite.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, scan_object, skip_ws
from vllm_lite.entrypoints.openai.tool_parsers.registry import ToolParserManager

START, END = "<tool_call>", "</tool_call>"


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            keep = 0 if final else held_back(text, START)
            return ParsedOutput(text[: len(text) - keep])
        out = ParsedOutput(text[:first])
        try:
            self._calls(text, first, out)
        except MalformedJSON:
            return ParsedOutput(text, malformed=True)
        return out

    @staticmethod
    def _calls(text: str, pos: int, out: ParsedOutput) -> None:
        while pos >= 0:
            body = skip_ws(text, pos + len(START))
            if body >= len(text):
                return
            scan = scan_object(text, body)
            out.calls.append(call_from_object(text, scan))
            if scan.end is None:
                return
            tail = skip_ws(text, scan.end)
            rest = text[tail : tail + len(END)]
            if not END.startswith(rest):
                raise MalformedJSON(f"expected {END!r} after the call at {tail}")
            if len(rest) < len(END):
                return
            pos = text.find(START, tail + len(END))
