"""Streamed tool calls as the OpenAI API sends them: a diff between successive parses.

Each call's first delta carries its index, id, type and function name (arguments ""); later deltas
carry only the new argument text. Content streams as text. Nothing is ever taken back: a parse
that loses a call it had (text turned out malformed) leaves what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_lite.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, make_tool_call_id


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStreamer:
    """Feed it the generated text piece by piece; it returns what to send for each piece."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []  # per started call: argument characters sent
        self.ids: list[str] = []

    @property
    def tools_called(self) -> bool:
        return bool(self._args_sent)

    def feed(self, delta_text: str) -> StreamDelta:
        self.text += delta_text
        return self._diff(final=False)

    def finish(self) -> StreamDelta:
        """The rest, once the model has stopped (text held back as a possible marker is released)."""
        return self._diff(final=True)

    def _diff(self, final: bool) -> StreamDelta:
        parsed = self.parser.parse(self.text, final)
        out = StreamDelta()
        if len(parsed.content) > self._content_sent:
            out.content = parsed.content[self._content_sent :]
            self._content_sent = len(parsed.content)
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # later calls wait for this one's name, so indexes stay in order
            if i == len(self._args_sent):
                self.ids.append(make_tool_call_id())
                self._args_sent.append(len(call.arguments))
                out.tool_calls.append(ToolCallDelta(i, self.ids[i], call.name, call.arguments))
            elif len(call.arguments) > self._args_sent[i]:
                out.tool_calls.append(ToolCallDelta(i, arguments=call.arguments[self._args_sent[i] :]))
                self._args_sent[i] = len(call.arguments)
        return out
