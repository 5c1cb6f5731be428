"""What every tool-call parser shares: calls found so far in the model's text, and the final extraction.

A parser is a pure function of the text generated so far (`parse(text, final)`): the content and the
calls it finds only grow as the text grows, so streaming is a diff of two parses (streaming.py) and
the whole response is one parse of the final text. Parsers work on plain data; serving_chat turns
it into the OpenAI response types.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from vllm_lite.entrypoints.openai.tool_parsers.json_scan import MalformedJSON, ObjectScan


def make_tool_call_id() -> str:
    """vLLM's id shape for a tool call."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class PartialCall:
    name: Optional[str]  # None until the whole name has arrived
    arguments: str  # JSON text of the arguments so far
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str  # text that is surely content (a possible tool-call marker at the end is held back)
    calls: list[PartialCall] = field(default_factory=list)
    malformed: bool = False  # tool-call text that is not a tool call: everything is content


@dataclass
class ExtractedToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ExtractedToolCall]
    content: Optional[str]


class ToolParser(ABC):
    """Finds tool calls in generated text; subclasses registered by name are `--tool-call-parser` choices."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls in `text`; `final`: no more text will come (hold nothing back)."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCallInformation:
        """The whole response: its calls, or all of it as content when the calls do not parse."""
        parsed = self.parse(text, final=True)
        calls = []
        for call in parsed.calls:
            if call.name is None or not call.complete or not _is_json(call.arguments):
                parsed.malformed = True
                break
            calls.append(ExtractedToolCall(call.name, call.arguments))
        if parsed.malformed or not calls:
            return ExtractedToolCallInformation(False, [], text)
        content = parsed.content if parsed.content.strip() else None
        return ExtractedToolCallInformation(True, calls, content)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def call_from_object(
    text: str, scan: ObjectScan, name_key: str = "name", argument_keys: tuple[str, ...] = ("arguments",)
) -> PartialCall:
    """A call from a scanned `{"name": ..., "arguments": {...}}` object (arguments text as generated).

    Arguments given as a JSON string (some models do) are that string once it is complete.
    """
    name = None
    span = scan.fields.get(name_key)
    if span is not None and span.end is not None:
        value = json.loads(text[span.start : span.end])
        if not isinstance(value, str):
            raise MalformedJSON(f"tool call name must be a string, got {value!r}")
        name = value
    args_span = next((scan.fields[k] for k in argument_keys if k in scan.fields), None)
    if args_span is None:
        arguments = "{}" if scan.end is not None else ""
    elif text.startswith('"', args_span.start):
        arguments = json.loads(text[args_span.start : args_span.end]) if args_span.end is not None else ""
    else:
        arguments = text[args_span.start : args_span.end]
    complete = scan.end is not None
    if complete and name is None:
        raise MalformedJSON(f"tool call has no {name_key!r}")
    return PartialCall(name, arguments, complete)
