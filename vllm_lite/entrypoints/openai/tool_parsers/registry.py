"""Tool-call parsers by name, as `--tool-call-parser NAME` selects them (vLLM's ToolParserManager)."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T", bound=type)


class ToolParserManager:
    tool_parsers: dict[str, type] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[T], T]:
        def register(parser_cls: T) -> T:
            if name in cls.tool_parsers and cls.tool_parsers[name] is not parser_cls:
                raise KeyError(f"tool parser {name!r} is already registered")
            cls.tool_parsers[name] = parser_cls
            return parser_cls

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        try:
            return cls.tool_parsers[name]
        except KeyError:
            raise KeyError(
                f"tool parser {name!r} is not registered; choose one of {', '.join(sorted(cls.tool_parsers))}"
            ) from None

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.tool_parsers)
