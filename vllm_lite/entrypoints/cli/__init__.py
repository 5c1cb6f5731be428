"""`vllm-lite` command line: every subcommand is one `CLISubcommand` in `SUBCOMMANDS`.

To add a subcommand, write a module here with a `CLISubcommand` subclass and add an
instance to `SUBCOMMANDS`. Its `run(args)` returns the exit code. Subcommand modules
import heavy things (the engine, the server) inside `run`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from vllm_lite.entrypoints.cli.api_server import ApiServerCommand
from vllm_lite.entrypoints.cli.chat import ChatCommand
from vllm_lite.entrypoints.cli.generate import GenerateCommand
from vllm_lite.entrypoints.cli.serve import ServeCommand
from vllm_lite.entrypoints.cli.types import CLISubcommand
from vllm_lite.entrypoints.cli.worker import WorkerCommand

SUBCOMMANDS: tuple[CLISubcommand, ...] = (
    GenerateCommand(),
    ChatCommand(),
    ServeCommand(),
    ApiServerCommand(),
    WorkerCommand(),
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, CLISubcommand]]:
    from vllm_lite import __version__

    parser = argparse.ArgumentParser(
        prog="vllm-lite",
        description="vllm-lite: a small LLM inference engine in the shape of vLLM V1.",
    )
    parser.add_argument("--version", action="version", version=f"vllm-lite {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    by_name: dict[str, CLISubcommand] = {}
    for cmd in SUBCOMMANDS:
        if cmd.name in by_name:
            raise RuntimeError(f"two CLI subcommands are named {cmd.name!r}")
        cmd.add_parser(sub).set_defaults(func=cmd.run)
        by_name[cmd.name] = cmd
    return parser, by_name


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point (`vllm-lite = vllm_lite.entrypoints.cli:main`)."""
    parser, _ = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code = args.func(args)
        return code if isinstance(code, int) else 0
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError) as e:
        # Bad input (flags, prompt, model path): one clear line, no traceback.
        print(f"vllm-lite {args.subcommand}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # The engine failed the request or died (EngineDeadError is a RuntimeError too).
        print(f"vllm-lite {args.subcommand}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
