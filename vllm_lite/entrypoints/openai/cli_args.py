"""Flags of the OpenAI-compatible server (`vllm-lite api-server`, and each `serve` HTTP frontend).

Parsing only: it imports nothing of the server, so the server and the CLI both import it.
Engine flags are EngineArgs' own (`EngineArgs.add_cli_args`).
"""

from __future__ import annotations

import argparse
import json

from vllm_lite import envs
from vllm_lite.cli_flags import flag_name, flag_specs
from vllm_lite.engine_args import EngineArgs
from vllm_lite.entrypoints.openai.lora_modules import add_lora_modules_flag, check_lora_modules_args
from vllm_lite.entrypoints.openai.tool_parsers import ToolParserManager

# Engine flags that still mean something when attaching to a running core (--engine).
_ATTACH_FIELDS = ("model", "data_parallel_size", "served_model_name")


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    """vLLM's form for --allowed-origins and friends: a JSON list of strings."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def add_http_options(srv: argparse._ArgumentGroup) -> None:
    """vLLM's HTTP-layer flags (chat template, roles, CORS, TLS, root path, request log), same names and meaning."""
    srv.add_argument(
        "--chat-template",
        default=None,
        help="Chat template (a file path or the template text) used when a request sends none "
        "(default: the tokenizer's).",
    )
    srv.add_argument("--response-role", default="assistant", help="Role of the generated chat messages.")
    srv.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins, a JSON list.")
    srv.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list.")
    srv.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list.")
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    srv.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS with this key (with --ssl-certfile).")
    srv.add_argument("--ssl-certfile", default=None, help="Serve HTTPS with this certificate (with --ssl-keyfile).")
    srv.add_argument("--root-path", default="", help="URL prefix when behind a path-based proxy (FastAPI root_path).")
    srv.add_argument("--disable-log-requests", action="store_true", help="Do not log each generation request.")
    srv.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="Turn off uvicorn's per-request access log."
    )
    srv.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="Serve no OpenAPI schema or docs pages (/openapi.json, /docs, /redoc are 404).",
    )
    srv.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 << 20,
        help="Largest HTTP request body accepted, in bytes; a larger one gets 413 before it is parsed "
        "(0: no limit; vLLM has no such flag).",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let chat requests use tool_choice "auto" (the default when tools are given); needs --tool-call-parser.',
    )
    srv.add_argument(
        "--tool-call-parser",
        default=None,
        choices=ToolParserManager.names(),
        help="How tool calls are read out of the model's replies under tool_choice auto (vLLM's parser names).",
    )
    add_lora_modules_flag(srv)


def check_tool_args(args: argparse.Namespace) -> None:
    """ValueError, as vLLM refuses them at start-up: --enable-auto-tool-choice without a parser, and
    --lora-modules without --enable-lora."""
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser (one of: " + ", ".join(ToolParserManager.names()) + ")."
        )
    check_lora_modules_args(args)


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's and the engine's options to `parser`."""
    srv = parser.add_argument_group("server")
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to bind (default 127.0.0.1, loopback only, unlike vLLM's all interfaces: "
        "pass --host 0.0.0.0 to serve other machines).",
    )
    srv.add_argument("--port", type=int, default=8000)
    add_http_options(srv)
    srv.add_argument(
        "--api-key",
        default=envs.VLLM_LITE_API_KEY,
        help="Require 'Authorization: Bearer KEY' on API routes (default: $VLLM_LITE_API_KEY, else open).",
    )
    srv.add_argument(
        "--health-stuck-timeout",
        type=_positive_float,
        default=60.0,
        help="Seconds of pending requests without a finished engine step before /health reports 503.",
    )
    srv.add_argument(
        "--engine-dead-grace",
        type=_positive_float,
        default=1.0,
        help="Seconds to keep answering 503 after the private engine died before exiting with code 1 (with --engine "
        "the server stays up, /health 503, and re-attaches when a core answers at the address again).",
    )
    srv.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    att = parser.add_argument_group("attach (instead of --model)")
    att.add_argument(
        "--engine",
        default=None,
        metavar="ADDRESS",
        help="Attach to a running `vllm-lite serve` core at ADDRESS instead of spawning one (with -dp D: its D cores).",
    )
    att.add_argument(
        "--auth-token", default=envs.VLLM_LITE_AUTH_TOKEN, help="Token for --engine (default: $VLLM_LITE_AUTH_TOKEN)."
    )
    EngineArgs.add_cli_args(parser)
    return parser


def check_api_server_args(args: argparse.Namespace) -> None:
    """ValueError unless exactly one of --model and --engine is given, no engine flag would be ignored,
    and TLS gets both of its files."""
    check_tool_args(args)
    if bool(getattr(args, "ssl_keyfile", None)) != bool(getattr(args, "ssl_certfile", None)):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: pass both for HTTPS.")
    if not args.model and not args.engine:
        raise ValueError("pass --model PATH (spawn an engine core) or --engine ADDRESS (attach to one).")
    if args.model and args.engine:
        raise ValueError("pass only one of --model and --engine.")
    if args.engine:
        ignored = [
            flag_name(spec.name)
            for spec in flag_specs(EngineArgs)
            if spec.name not in _ATTACH_FIELDS and getattr(args, spec.name, None) != spec.kwargs["default"]
        ]
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)}: a running core's engine arguments are fixed by its daemon; "
                "drop them with --engine."
            )


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs for the private core of `api-server --model PATH`."""
    if not args.model:
        raise ValueError("--model is required (or --engine ADDRESS to attach to a running core).")
    return EngineArgs.from_cli_args(args)
