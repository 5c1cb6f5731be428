"""The shape of one `vllm-lite` subcommand, so new ones (serve, api-server, worker) plug in alike."""

from __future__ import annotations

import argparse


class CLISubcommand:
    """One subcommand: declares its arguments, then runs with the parsed namespace.

    Modules under `vllm_lite.entrypoints.cli` expose `subcommands() -> list[CLISubcommand]`
    and are listed in `SUBCOMMAND_MODULES` in the package's `__init__`.
    """

    name: str = ""
    help: str = ""

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        raise NotImplementedError

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the process exit code."""
        raise NotImplementedError
