"""One HTTP frontend of `vllm-lite serve --api-port P --api-servers N` (a child of the supervisor).

It is the OpenAI server (`build_app` / `serve_app`) with an AsyncLLM attached to
the daemon's core(s), accepting on a listening socket the supervisor bound and
passed down (``--listen-fd``), so N frontends share one port. It tells the
supervisor it is serving by writing to ``--ready-fd``, and watches the cores'
pids (``--core-pids``): when a core dies it exits 1 at once instead of waiting
for a heartbeat to go unanswered -- unless the supervisor first wrote ``stop`` on
its stdin (``--control-stdin``): then the cores are draining on purpose and
their exit ends this frontend cleanly (exit 0). Secrets come from the environment
(``VLLM_LITE_AUTH_TOKEN``, ``VLLM_LITE_API_KEY``), never from the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Any, Callable, Optional

logger = logging.getLogger("vllm_lite.serve_frontend")


def make_parser() -> argparse.ArgumentParser:
    from vllm_lite.entrypoints.openai.cli_args import make_arg_parser

    p = make_arg_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    g = p.add_argument_group("serve frontend")
    g.add_argument("--listen-fd", type=int, required=True, help="Inherited listening socket to accept on.")
    g.add_argument("--ready-fd", type=int, default=None, help="Pipe to write one byte to once serving.")
    g.add_argument("--core-pids", default="", help="Comma-separated engine core pids to watch.")
    g.add_argument("--control-stdin", action="store_true",
                   help="The supervisor writes 'stop' on stdin before stopping the cores: their exit is then clean.")
    g.add_argument("--frontend-name", default="", help="Name this frontend gives the core(s) (their logs show it).")
    return p


def build_attached_engine(args: argparse.Namespace) -> Any:
    """AsyncLLM attached to every core listed in ``--engine`` (comma-separated for data parallel)."""
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.client.dp_client import make_attached_client
    from vllm_lite.client.llm_engine import attached_frontend_config

    client = make_attached_client(
        args.engine, args.auth_token, asyncio_mode=True, client_name=args.frontend_name or f"http-pid{os.getpid()}"
    )
    try:
        return AsyncLLM(attached_frontend_config(client), client=client)
    except BaseException:
        client.shutdown()
        raise


def watch_pids(loop: asyncio.AbstractEventLoop, pids: list[int], on_exit: Callable[[int], None]) -> list[int]:
    """Call ``on_exit(pid)`` on the loop when any of ``pids`` exits (Linux pidfds); returns fds to close."""
    fds: list[int] = []
    pidfd_open = getattr(os, "pidfd_open", None)
    for pid in pids:
        if pidfd_open is None:
            break
        try:
            fd = pidfd_open(pid)
        except OSError:  # already gone (or no pidfd support): treat as exited
            loop.call_soon(on_exit, pid)
            continue
        fds.append(fd)
        loop.add_reader(fd, on_exit, pid)
    return fds


async def serve(args: argparse.Namespace) -> int:
    """Attach, serve HTTP on the inherited socket until told to stop or a core dies; the exit code."""
    from vllm_lite.entrypoints.openai.api_server import build_app, serve_app

    engine = build_attached_engine(args)
    loop = asyncio.get_running_loop()
    pidfds: list[int] = []
    try:
        # Starts the client's receive and heartbeat tasks now, so the core does not drop us as silent.
        await engine.call_utility_async("ping")
        app = build_app(
            engine,
            args.served_model_name or None,
            api_key=args.api_key,
            health_stuck_timeout_s=args.health_stuck_timeout,
            engine_dead_grace_s=args.engine_dead_grace,
        )

        stopping = {"flag": False}

        def core_exited(pid: int) -> None:
            for fd in pidfds:
                try:
                    loop.remove_reader(fd)
                except (ValueError, RuntimeError):
                    pass
            server = app.state.server
            if stopping["flag"] and server is not None:
                server.should_exit = True  # the supervisor is stopping everything: a clean exit
                return
            loop.create_task(app.state.health_monitor.notify_dead(f"the engine core process (pid {pid}) exited"))

        if args.control_stdin:
            def on_control() -> None:
                data = os.read(0, 64)
                if not data or b"stop" in data:
                    loop.remove_reader(0)
                if b"stop" in data:
                    stopping["flag"] = True

            loop.add_reader(0, on_control)

        pids = [int(p) for p in args.core_pids.split(",") if p.strip()]
        pidfds = watch_pids(loop, pids, core_exited)
        sock = socket.socket(fileno=args.listen_fd)
        task = loop.create_task(serve_app(app, sock=sock, log_level=args.uvicorn_log_level))
        while not task.done():
            server = app.state.server
            if server is not None and getattr(server, "started", False):
                break
            await asyncio.sleep(0.02)
        if args.ready_fd is not None:
            if not task.done():
                os.write(args.ready_fd, b"R")
            os.close(args.ready_fd)
        return await task
    finally:
        for fd in pidfds:
            try:
                loop.remove_reader(fd)
            except (ValueError, RuntimeError):
                pass
            os.close(fd)
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 -- exiting anyway
            logger.exception("engine shutdown failed")


def main(argv: Optional[list[str]] = None) -> int:
    from vllm_lite.client.core_client import set_frontend_thread_policy

    from vllm_lite.logging_utils import configure_process_logging

    configure_process_logging("http %(process)d")
    args = make_parser().parse_args(argv)
    if not args.engine:
        print("serve_frontend: --engine ADDRESS is required", file=sys.stderr)
        return 2
    set_frontend_thread_policy()
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
