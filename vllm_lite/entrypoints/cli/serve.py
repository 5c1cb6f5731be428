"""`vllm-lite serve [MODEL]`: the OpenAI API on --port as `vllm serve` gives it, over engine core(s) that
other frontends can attach to as well (see `serve_daemon`); `--headless` runs the core(s) alone."""

from __future__ import annotations

import argparse
import logging

from vllm_lite import envs
from vllm_lite.entrypoints.cli.engine_args import add_engine_args
from vllm_lite.entrypoints.cli.types import CLISubcommand

EPILOG = """\
examples:
  vllm-lite serve MODEL                      # as `vllm serve MODEL`: the OpenAI API on 127.0.0.1:8000
  vllm-lite serve MODEL --host 0.0.0.0 --port 8000 --api-key KEY --api-server-count 2
      2 HTTP frontends sharing port 8000 on every interface (loopback by default, unlike vLLM)
  vllm-lite serve MODEL --core-port 8100     # the engine core's ZMQ address (printed at start-up)
      other frontends attach while it runs: LLM(engine_address="tcp://127.0.0.1:8100"),
      AsyncLLM.attach("tcp://127.0.0.1:8100"), vllm-lite api-server --engine tcp://127.0.0.1:8100
  vllm-lite serve MODEL --headless --core-host 0.0.0.0 --auth-token SECRET
      the engine core alone; a non-loopback core needs a token

A core's tcp address uses two ports, P and P+1 (and P+2r, P+2r+1 for data-parallel rank r).
Old spellings: --api-port/--api-host (HTTP) still work and then leave --port/--host to the core, as before;
--address is --core-address.
"""

logger = logging.getLogger("vllm_lite.serve")


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
    help = "Serve the OpenAI API as `vllm serve` does, over an engine core other frontends can attach to."

    def add_parser(self, subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
        from vllm_lite.entrypoints.serve_daemon import (
            DEFAULT_HEARTBEAT_TIMEOUT_S,
            DEFAULT_PORT,
            DEFAULT_SHUTDOWN_TIMEOUT_S,
        )

        p = subparsers.add_parser(
            self.name,
            help=self.help,
            description=self.help,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        from vllm_lite.entrypoints.openai.cli_args import add_http_options

        h = p.add_argument_group("OpenAI HTTP API (as vllm serve)")
        h.add_argument(
            "--host",
            default=None,
            help="Address the HTTP API binds (default 127.0.0.1, loopback only, unlike vLLM's all "
            "interfaces: pass --host 0.0.0.0 to serve other machines).",
        )
        h.add_argument("--port", type=int, default=None, help="HTTP API port (default 8000; 0: a free one).")
        h.add_argument(
            "--headless",
            action="store_true",
            help="No HTTP API: run the engine core(s) alone, for frontends that attach.",
        )
        h.add_argument(
            "--api-server-count",
            "--api-servers",
            dest="api_servers",
            type=int,
            default=1,
            help="HTTP frontend processes, all attached to the core(s), sharing the port.",
        )
        h.add_argument(
            "--api-key",
            default=envs.VLLM_LITE_API_KEY,
            help="Require 'Authorization: Bearer KEY' on the HTTP API (default: $VLLM_LITE_API_KEY).",
        )
        h.add_argument(
            "--uvicorn-log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
        )
        add_http_options(h)
        h.add_argument("--api-port", type=int, default=None, help=argparse.SUPPRESS)  # old spelling of --port
        h.add_argument("--api-host", default=None, help=argparse.SUPPRESS)  # old spelling of --host
        d = p.add_argument_group("engine core (attachable)")
        d.add_argument("--core-host", default=None, help="Address the engine core binds (default: loopback only).")
        d.add_argument(
            "--core-port",
            type=int,
            default=None,
            help=f"First of the two TCP ports the core binds (default {DEFAULT_PORT}; 0: pick free ones).",
        )
        d.add_argument(
            "--core-address",
            "--address",
            dest="address",
            default=None,
            metavar="ADDRESS",
            help="Bind the core at this tcp://HOST:PORT or ipc:///PATH instead of --core-host/--core-port.",
        )
        d.add_argument(
            "--auth-token",
            default=envs.VLLM_LITE_AUTH_TOKEN,
            help="Frontends must present this token (default: $VLLM_LITE_AUTH_TOKEN). "
            "Required to bind a non-loopback address.",
        )
        d.add_argument(
            "--heartbeat-timeout",
            type=_positive_float,
            default=DEFAULT_HEARTBEAT_TIMEOUT_S,
            help="Seconds of silence after which a frontend is dropped and its requests aborted.",
        )
        d.add_argument(
            "--shutdown-timeout",
            type=_non_negative_float,
            default=DEFAULT_SHUTDOWN_TIMEOUT_S,
            help="On SIGTERM/SIGINT, seconds to let running requests finish before aborting them.",
        )
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


def _split_host_port(args: argparse.Namespace) -> tuple[str, int | None, str, int | None]:
    """(HTTP host, HTTP port, core host, core port) from the flags, old spellings included.

    New (vLLM's): --host/--port are the HTTP API, --core-host/--core-port the core. Old: with
    --api-port/--api-host given, those are the HTTP API and --host/--port keep meaning the core.
    """
    legacy = args.api_port is not None or args.api_host is not None
    if not legacy:
        return args.host or "127.0.0.1", 8000 if args.port is None else args.port, args.core_host, args.core_port
    if args.core_host is not None or args.core_port is not None:
        raise ValueError(
            "--api-port/--api-host are the old spellings of --port/--host: with --core-host/--core-port "
            "use --port/--host for the HTTP API."
        )
    logger.warning(
        "--api-port/--api-host are the old spellings: the HTTP API is now on --port/--host and the "
        "engine core on --core-port/--core-host (as `vllm serve`); the old meaning is kept here."
    )
    return args.api_host or "127.0.0.1", args.api_port, args.host, args.port


def serve_config_from(args: argparse.Namespace):
    """ServeConfig from the parsed flags (ValueError on bad ones, before anything starts)."""
    from vllm_lite.engine_args import EngineArgs
    from vllm_lite.entrypoints.openai.api_server import server_options
    from vllm_lite.entrypoints.serve_daemon import ServeConfig, make_address

    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}.")
    http_host, http_port, core_host, core_port = _split_host_port(args)
    if core_port is not None and not 0 <= core_port < 65535:
        raise ValueError(f"--core-port must be 0..65534, got {core_port}.")
    if args.address and (core_port is not None or core_host is not None):
        raise ValueError("pass either --core-address or --core-host/--core-port, not both.")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: pass both for HTTPS.")
    engine_args = EngineArgs.from_cli_args(args)  # no MODEL: the bundled default model
    if args.headless and engine_args.override_generation_config:
        raise ValueError(
            "--override-generation-config sets the request defaults of serve's HTTP frontends; --headless starts "
            "none (frontends that attach later build their own requests)."
        )
    return ServeConfig(
        engine_args=engine_args,
        address=make_address(core_host or "127.0.0.1", core_port, args.address),
        auth_token=args.auth_token or None,
        heartbeat_timeout_s=args.heartbeat_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        data_parallel_size=args.data_parallel_size,
        api_port=None if args.headless else http_port,
        api_host=http_host,
        api_servers=args.api_servers,
        api_key=args.api_key or None,
        served_model_names=list(args.served_model_name or []),
        uvicorn_log_level=args.uvicorn_log_level,
        http_options={
            **server_options(args),
            "ssl_keyfile": args.ssl_keyfile,
            "ssl_certfile": args.ssl_certfile,
            # Request defaults are the frontends' (they build requests); the core does not report them.
            "override_generation_config": engine_args.override_generation_config,
        },
    )
