"""`--lora-modules`: the adapters a server offers from start-up, in vLLM's two spellings.

Parsing only (no server imports), so the CLI, the serve supervisor and each HTTP frontend share it;
`LoRAModulePath` is a msgspec struct because it travels to `serve`'s frontends inside `FrontendArgs`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional, Sequence

import msgspec


class LoRAModulePath(msgspec.Struct, frozen=True):
    """One adapter served under ``name`` (vLLM's fields); ``base_model_name`` is the card's ``parent``."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``; ValueError naming the flag."""
    text = item.strip()
    if not text.startswith("{"):
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {item!r}.")
        return LoRAModulePath(name=name, path=path)
    try:
        value: Any = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--lora-modules: invalid JSON {item!r}: {e}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"--lora-modules: expected a JSON object, got {item!r}.")
    unknown = sorted(set(value) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"--lora-modules: unknown field(s) {', '.join(unknown)} in {item!r}.")
    for key in ("name", "path"):
        if not isinstance(value.get(key), str) or not value[key]:
            raise ValueError(f"--lora-modules: {key!r} must be a non-empty string in {item!r}.")
    base = value.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules: 'base_model_name' must be a string in {item!r}.")
    return LoRAModulePath(name=value["name"], path=value["path"], base_model_name=base)


def parse_lora_modules(items: Optional[Sequence[str]]) -> list[LoRAModulePath]:
    """Every ``--lora-modules`` value (the flag takes several, and may be repeated); names must be unique."""
    modules = [parse_lora_module(item) for item in items or () if item.strip()]
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"--lora-modules: the adapter name {m.name!r} is given twice.")
        seen.add(m.name)
    return modules


class LoRAModulesAction(argparse.Action):
    """argparse: collect ``--lora-modules`` values (nargs='+', repeatable) into LoRAModulePath entries."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None):
        previous = list(getattr(namespace, self.dest, None) or [])
        try:
            modules = parse_lora_modules(values)
        except ValueError as e:
            parser.error(str(e))
        names = {m.name for m in previous}
        for m in modules:
            if m.name in names:
                parser.error(f"--lora-modules: the adapter name {m.name!r} is given twice.")
        setattr(namespace, self.dest, previous + modules)


def add_lora_modules_flag(group: Any) -> None:
    """vLLM's ``--lora-modules`` (needs ``--enable-lora``: `check_lora_modules_args`)."""
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action=LoRAModulesAction,
        default=[],
        metavar="MODULE",
        help="LoRA adapters to serve, each chosen by its name in a request's `model`: name=path, or JSON "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "MODEL"}\'; several at once. '
        "Needs --enable-lora.",
    )


def check_lora_modules_args(args: argparse.Namespace) -> None:
    """ValueError for --lora-modules without --enable-lora (vLLM serves no adapter then). Attached to a
    running core (`api-server --engine`), the core's own --enable-lora decides, when the adapters load."""
    if getattr(args, "engine", None):
        return
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora (the engine serves no LoRA adapter without it).")
