"""Engine flags for the subcommands that build an engine, generated once from `EngineArgs`."""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any, Iterator, Sequence

from vllm_lite.engine_args import EngineArgs

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_engine_args(
    parser: argparse.ArgumentParser,
    *,
    exclude: Sequence[str] = (),
    positional_model: bool = False,
    multiprocess: bool = False,
    log_level: str | None = None,
) -> None:
    """Every EngineArgs flag (less `exclude`), plus --[no-]multiprocess and --log-level where asked.

    `log_level`: the default of --log-level, this process's "vllm_lite" log level while the engine
    runs (engine cores started from here take it too).
    """
    EngineArgs.add_cli_args(parser, exclude=exclude, positional_model=positional_model)
    g = parser.add_argument_group("engine process")
    if multiprocess:
        g.add_argument(
            "--multiprocess",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Run the engine core in its own process (--no-multiprocess: in this one, for debugging).",
        )
    if log_level is not None:
        g.add_argument(
            "--log-level",
            type=str.lower,
            choices=LOG_LEVELS,
            default=log_level,
            help=f"vllm-lite's log level, engine core included (default {log_level}).",
        )


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the flags; a sampling --seed (generate, chat) seeds the engine too."""
    overrides: dict[str, Any] = {}
    if hasattr(args, "seed") and args.seed is None:  # the sampling flag, unset: the engine's default seed
        overrides["seed"] = EngineArgs.__dataclass_fields__["seed"].default
    return EngineArgs.from_cli_args(args, **overrides)


@contextlib.contextmanager
def vllm_lite_log_level(level: str) -> Iterator[None]:
    """Set this process's "vllm_lite" logger level for the block (restored after)."""
    logger = logging.getLogger("vllm_lite")
    previous = logger.level
    logger.setLevel(level.upper())
    try:
        yield
    finally:
        logger.setLevel(previous)


def build_engine(args: argparse.Namespace) -> Any:
    """An LLMEngine for the flags (its core in its own process unless --no-multiprocess).

    Call it inside `vllm_lite_log_level(args.log_level)`: an interactive command's core logs
    warnings only by default, since INFO lines would interleave with the streamed text.
    """
    from vllm_lite.client.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args_from(args), multiprocess_mode=args.multiprocess)
