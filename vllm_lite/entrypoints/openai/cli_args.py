"""`vllm-lite api-server`: argument parsing for the OpenAI-compatible server.

Kept apart from the main CLI so the `vllm-lite` entry point can register the
subcommand with two lines (`add_api_server_parser(subparsers)`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from vllm_lite.config import EngineArgs


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
    eng.add_argument("--tokenizer", default=None)
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    eng.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="Reuse KV blocks of shared prompt prefixes.",
    )
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=128)
    eng.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    eng.add_argument("--tensor-parallel-size", type=int, default=1)
    eng.add_argument("--device", default="auto")
    eng.add_argument("--num-threads", type=int, default=None)
    return parser


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    if not args.model:
        raise ValueError("--model is required (or --engine ADDRESS to attach to a running core).")
    names = args.served_model_name or []
    return EngineArgs(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        scheduling_policy=args.scheduling_policy,
        tensor_parallel_size=args.tensor_parallel_size,
        device=args.device,
        num_threads=args.num_threads,
        served_model_name=names[0] if names else None,
    )


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
