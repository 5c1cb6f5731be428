"""Tool-call parsers: `--enable-auto-tool-choice --tool-call-parser NAME` picks one by name (vLLM's names).

Importing this package registers the built-in parsers: hermes, llama3_json, mistral.
"""

from vllm_lite.entrypoints.openai.tool_parsers import (  # noqa: F401  (registration)
    hermes_tool_parser,
    llama3_json_tool_parser,
    mistral_tool_parser,
)
from vllm_lite.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCall,
    ExtractedToolCallInformation,
    ParsedOutput,
    PartialCall,
    ToolParser,
)
from vllm_lite.entrypoints.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from vllm_lite.entrypoints.openai.tool_parsers.registry import ToolParserManager
from vllm_lite.entrypoints.openai.tool_parsers.streaming import StreamDelta, ToolCallDelta, ToolCallStreamer

__all__ = [
    "ExtractedToolCall",
    "ExtractedToolCallInformation",
    "NamedToolCallParser",
    "ParsedOutput",
    "PartialCall",
    "RequiredToolCallsParser",
    "StreamDelta",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "ToolParserManager",
]
