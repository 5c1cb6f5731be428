"""`vllm-lite api-server`: argument parsing for the OpenAI-compatible server.

Kept apart from the main CLI so the `vllm-lite` entry point can register the
subcommand with two lines (`add_api_server_parser(subparsers)`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from vllm_lite.config import EngineArgs
from vllm_lite.entrypoints.cli.engine_args import add_engine_args, engine_kwargs_from


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's and the engine's options to `parser`."""
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="Address to bind (default: loopback only).")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_LITE_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on API routes (default: $VLLM_LITE_API_KEY, else open).",
    )
    srv.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="Model name(s) clients use; the first is reported in responses (default: the model path).",
    )
    srv.add_argument(
        "--health-stuck-timeout", type=_positive_float, default=60.0,
        help="Seconds of pending requests without a finished engine step before /health reports 503.",
    )
    srv.add_argument(
        "--engine-dead-grace", type=_positive_float, default=1.0,
        help="Seconds to keep answering 503 after the engine died before exiting with code 1.",
    )
    srv.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])

    eng = parser.add_argument_group("engine")
    eng.add_argument("--model", default=None, help="Local checkpoint directory (spawns a private engine core).")
    eng.add_argument(
        "--engine", default=None, metavar="ADDRESS",
        help="Attach to a running `vllm-lite serve` core at ADDRESS instead of spawning one.",
    )
    eng.add_argument("--auth-token", default=os.environ.get("VLLM_LITE_AUTH_TOKEN"), help="Token for --engine.")
    add_engine_args(parser, model_option=False, seed=True, multiprocess=False)
    return parser


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    if not args.model:
        raise ValueError("--model is required (or --engine ADDRESS to attach to a running core).")
    names = args.served_model_name or []
    return EngineArgs(model=args.model, served_model_name=names[0] if names else None, **engine_kwargs_from(args))


def add_api_server_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `api-server` on the main CLI's subparsers; `args.func(args)` runs it."""
    parser = subparsers.add_parser(
        "api-server",
        help="Run the OpenAI-compatible HTTP server.",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /health, /metrics.",
    )
    make_arg_parser(parser)
    parser.set_defaults(func=run_api_server)
    return parser


def run_api_server(args: argparse.Namespace) -> int:
    """Run until shutdown; returns the exit code: 1 when the engine died (so a supervisor restarts the server)."""
    from vllm_lite.entrypoints.openai.api_server import run_server

    if not args.model and not args.engine:
        raise ValueError("pass --model PATH (spawn an engine core) or --engine ADDRESS (attach to one).")
    if args.model and args.engine:
        raise ValueError("pass only one of --model and --engine.")
    return run_server(args)
