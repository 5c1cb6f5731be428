"""`vllm-lite` command line: one module per subcommand, dispatched by argparse.

To add a subcommand (e.g. `serve`), either write `vllm_lite/entrypoints/cli/serve.py`
with `subcommands() -> list[CLISubcommand]` and add its module name to
`SUBCOMMAND_MODULES`, or add "module:function" to `PARSER_REGISTRARS` for a
function that takes the subparsers and sets `func` (run with the namespace;
its return value, if an int, is the exit code). Modules should import heavy
things (torch, the engine) inside the run function, so `vllm-lite --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from vllm_lite.entrypoints.cli.types import CLISubcommand

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "vllm_lite.entrypoints.cli.generate",
    "vllm_lite.entrypoints.cli.chat",
    "vllm_lite.entrypoints.cli.worker",
    "vllm_lite.entrypoints.cli.serve",
)

PARSER_REGISTRARS: tuple[str, ...] = (
    "vllm_lite.entrypoints.openai.cli_args:add_api_server_parser",
)


def load_subcommands() -> list[CLISubcommand]:
    cmds: list[CLISubcommand] = []
    for name in SUBCOMMAND_MODULES:
        cmds.extend(importlib.import_module(name).subcommands())
    return cmds


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, CLISubcommand]]:
    from vllm_lite import __version__

    parser = argparse.ArgumentParser(
        prog="vllm-lite",
        description="vllm-lite: a small LLM inference engine in the shape of vLLM V1.",
    )
    parser.add_argument("--version", action="version", version=f"vllm-lite {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    by_name: dict[str, CLISubcommand] = {}
    for cmd in load_subcommands():
        if cmd.name in by_name:
            raise RuntimeError(f"two CLI subcommands are named {cmd.name!r}")
        cmd.add_parser(sub).set_defaults(func=cmd.run)
        by_name[cmd.name] = cmd
    for spec in PARSER_REGISTRARS:
        module, _, func = spec.partition(":")
        getattr(importlib.import_module(module), func)(sub)
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
