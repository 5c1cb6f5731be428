"""The shape of one `vllm-lite` subcommand, so every subcommand plugs in alike."""

from __future__ import annotations

import argparse


class CLISubcommand:
    """One subcommand: declares its arguments, then runs with the parsed namespace.

    Every subcommand is one instance in `SUBCOMMANDS` in the package's `__init__`. Its module
    imports heavy things (torch, the engine) inside `run`, so `vllm-lite --help` stays quick.
    """

    name: str = ""
    help: str = ""

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        raise NotImplementedError

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the process exit code."""
        raise NotImplementedError
