"""`vllm-lite api-server`: the OpenAI-compatible HTTP server, on a private core or attached to a daemon."""

from __future__ import annotations

import argparse

from vllm_lite.entrypoints.cli.types import CLISubcommand


class ApiServerCommand(CLISubcommand):
    name = "api-server"
    help = "Run the OpenAI-compatible HTTP server."

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        from vllm_lite.entrypoints.openai.cli_args import make_arg_parser

        p = subparsers.add_parser(
            self.name,
            help=self.help,
            description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /health, /metrics.",
        )
        return make_arg_parser(p)

    def run(self, args: argparse.Namespace) -> int:
        """Exit code 1 when the engine died: a private one ends the server (so a supervisor restarts it); an
        attached one (--engine) leaves it up with /health 503 until a core answers at the address again."""
        from vllm_lite.entrypoints.openai.api_server import run_server
        from vllm_lite.entrypoints.openai.cli_args import check_api_server_args

        check_api_server_args(args)
        return run_server(args)
