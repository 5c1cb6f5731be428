"""`vllm-lite serve [MODEL]`: run engine core(s) that frontends attach to (see `serve_daemon`)."""

from __future__ import annotations

import argparse

from vllm_lite import envs
from vllm_lite.entrypoints.cli.engine_args import add_engine_args
from vllm_lite.entrypoints.cli.types import CLISubcommand

EPILOG = """\
examples:
  vllm-lite serve MODEL_DIR --port 8100
      then, from other processes: LLM(engine_address="tcp://127.0.0.1:8100"),
      AsyncLLM.attach("tcp://127.0.0.1:8100"), vllm-lite api-server --engine tcp://127.0.0.1:8100
  vllm-lite serve MODEL_DIR --api-port 8000 --api-servers 2
      the core plus 2 OpenAI HTTP frontends sharing port 8000
  vllm-lite serve MODEL_DIR --host 0.0.0.0 --auth-token SECRET
      any non-loopback bind needs a token

A tcp address uses two ports, P and P+1 (and P+2r, P+2r+1 for data-parallel rank r).
"""


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


class ServeCommand(CLISubcommand):
    name = "serve"
    help = "Run a long-lived engine core that frontends (Python or HTTP) attach to."

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        from vllm_lite.entrypoints.serve_daemon import (
            DEFAULT_HEARTBEAT_TIMEOUT_S,
            DEFAULT_PORT,
            DEFAULT_SHUTDOWN_TIMEOUT_S,
        )

        p = subparsers.add_parser(
            self.name, help=self.help, description=self.help, epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        d = p.add_argument_group("daemon")
        d.add_argument("--host", default="127.0.0.1", help="Address the core binds (default: loopback only).")
        d.add_argument("--port", type=int, default=None,
                       help=f"First of the two TCP ports the core binds (default {DEFAULT_PORT}; 0: pick free ones).")
        d.add_argument("--address", default=None, metavar="ADDRESS",
                       help="Bind this tcp://HOST:PORT or ipc:///PATH instead of --host/--port.")
        d.add_argument("--auth-token", default=envs.VLLM_LITE_AUTH_TOKEN,
                       help="Frontends must present this token (default: $VLLM_LITE_AUTH_TOKEN). "
                            "Required to bind a non-loopback address.")
        d.add_argument("--heartbeat-timeout", type=_positive_float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                       help="Seconds of silence after which a frontend is dropped and its requests aborted.")
        d.add_argument("--shutdown-timeout", type=_non_negative_float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="On SIGTERM/SIGINT, seconds to let running requests finish before aborting them.")
        h = p.add_argument_group("HTTP frontends")
        h.add_argument("--api-port", type=int, default=None,
                       help="Also start OpenAI-compatible HTTP frontends on this port.")
        h.add_argument("--api-host", default="127.0.0.1", help="Address the HTTP frontends listen on.")
        h.add_argument("--api-servers", type=int, default=1,
                       help="HTTP frontend processes, all attached to the core(s), sharing --api-port.")
        h.add_argument("--api-key", default=envs.VLLM_LITE_API_KEY,
                       help="Require 'Authorization: Bearer KEY' on the HTTP API (default: $VLLM_LITE_API_KEY).")
        h.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug"])
        add_engine_args(p, positional_model=True)  # MODEL, -dp, --served-model-name, ... with the engine flags
        return p

    def run(self, args: argparse.Namespace) -> int:
        import sys

        from vllm_lite.client.exceptions import EngineStartupError
        from vllm_lite.entrypoints.serve_daemon import run_serve

        cfg = serve_config_from(args)
        try:
            return run_serve(cfg)
        except (EngineStartupError, RuntimeError) as e:
            print(f"vllm-lite serve: error: {e}", file=sys.stderr)
            return 1


def serve_config_from(args: argparse.Namespace):
    """ServeConfig from the parsed flags (ValueError on bad ones, before anything starts)."""
    from vllm_lite.config import EngineArgs
    from vllm_lite.entrypoints.serve_daemon import ServeConfig, make_address

    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}.")
    if args.port is not None and not 0 <= args.port < 65535:
        raise ValueError(f"--port must be 0..65534, got {args.port}.")
    if args.address and (args.port is not None or args.host != "127.0.0.1"):
        raise ValueError("pass either --address or --host/--port, not both.")
    engine_args = EngineArgs.from_cli_args(args)  # no MODEL: the bundled default model
    return ServeConfig(
        engine_args=engine_args,
        address=make_address(args.host, args.port, args.address),
        auth_token=args.auth_token or None,
        heartbeat_timeout_s=args.heartbeat_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        data_parallel_size=args.data_parallel_size,
        api_port=args.api_port,
        api_host=args.api_host,
        api_servers=args.api_servers,
        api_key=args.api_key or None,
        served_model_names=list(args.served_model_name or []),
        uvicorn_log_level=args.uvicorn_log_level,
    )

