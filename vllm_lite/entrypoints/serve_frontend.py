"""One HTTP frontend of `vllm-lite serve --api-port P --api-servers N` (a child of the supervisor).

It is the OpenAI server (`build_app` / `serve_app`) with an AsyncLLM attached to
the daemon's core(s), accepting on a listening socket the supervisor bound and
passed down (``FrontendArgs.listen_fd``), so N frontends share one port. It is
started by the launcher (``python -m vllm_lite.entrypoints.serve_frontend``), gets
its arguments -- secrets included -- as one typed struct over the launcher's pipe,
and answers ``FrontendReady`` once uvicorn serves. It watches the cores' pids (its client
watches them too, and heartbeats a core on another host): when a core dies, in-flight requests
fail at once (a stream gets an error event, then ``[DONE]``; others a 503), the server stays up
with ``/health`` at 503, and it re-attaches (HELLO again) each ``reattach_interval_s`` until a
core answers at the same address(es) -- or it is stopped: SIGTERM (exit 1 while the engine is
dead), or the supervisor's ``stop`` control first, when the cores are draining on purpose and
their exit ends this frontend cleanly (exit 0).

Start-up and heartbeats: from READY on, the core counts this frontend's silence (``--heartbeat-timeout``,
10 s) and the client heartbeats from a task on this event loop, so nothing slow may run on the loop after
HELLO: ``reattach.attach_app`` shakes hands and builds the tokenizer and the app in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, Callable, Optional

import msgspec

from vllm_lite.entrypoints.openai.lora_modules import LoRAModulePath
from vllm_lite.entrypoints.reattach import attach_app
from vllm_lite.launcher import open_pidfd
from vllm_lite.launcher_child import ChildChannel, Control, run_child

logger = logging.getLogger("vllm_lite.serve_frontend")

FRONTEND_MODULE = "vllm_lite.entrypoints.serve_frontend"


class FrontendArgs(msgspec.Struct, kw_only=True):
    """What the supervisor starts an HTTP frontend with."""

    engine: list[str]  # one address per data-parallel core
    listen_fd: int  # the inherited listening socket
    core_pids: list[int] = []
    frontend_name: str = ""
    auth_token: Optional[str] = None
    api_key: Optional[str] = None
    served_model_names: list[str] = []
    uvicorn_log_level: str = "warning"
    health_stuck_timeout_s: float = 60.0
    engine_dead_grace_s: float = 1.0
    # After the core died: seconds between attempts to attach again (the handshake's own timeout included).
    reattach_interval_s: float = 1.0
    # vLLM's HTTP options (api_server.build_app / serve_app keywords of the same names).
    chat_template: Optional[str] = None
    response_role: str = "assistant"
    root_path: str = ""
    allowed_origins: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    disable_log_requests: bool = False
    max_request_body_bytes: int = 16 << 20
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    lora_modules: list[LoRAModulePath] = []  # --lora-modules: loaded before the frontend says it is ready
    disable_fastapi_docs: bool = False
    disable_uvicorn_access_log: bool = False
    # --override-generation-config: request defaults this frontend lays over the checkpoint's.
    override_generation_config: Optional[dict[str, Any]] = None


class FrontendReady(msgspec.Struct):
    """The frontend serves HTTP on ``port``."""

    port: int


def watch_pids(loop: asyncio.AbstractEventLoop, pids: list[int], on_exit: Callable[[int], None]) -> list[int]:
    """Call ``on_exit(pid)`` on the loop when any of ``pids`` exits (Linux pidfds); returns fds to close."""
    fds: list[int] = []
    for pid in pids:
        fd = open_pidfd(pid)
        if fd is None:  # already gone, or no pidfd support: the heartbeat watch remains
            if not os.path.exists(f"/proc/{pid}"):
                loop.call_soon(on_exit, pid)
            continue
        fds.append(fd)
        loop.add_reader(fd, on_exit, pid)
    return fds


async def serve(
    args: FrontendArgs,
    channel: Optional[ChildChannel] = None,
    app_factory: Optional[Callable[..., Any]] = None,
    freeze_gc: bool = False,
) -> int:
    """Attach, serve HTTP on the inherited socket until told to stop or a core dies; the exit code.

    ``app_factory``: what builds the app (``api_server.build_app``'s signature; tests pass a slow one).
    ``freeze_gc``: this process is the frontend's own (``_main``): its start-up heap is frozen before it serves
    (``serve_app``'s freeze_gc); tests that call this in their own interpreter leave it off.
    """
    from vllm_lite.entrypoints.openai.api_server import build_app, init_static_loras, serve_app

    factory = app_factory or build_app
    loop = asyncio.get_running_loop()
    pidfds: list[int] = []
    # Attach and build the app with the loop free to heartbeat (see attach_app).
    app, engine, reattacher = await attach_app(
        args,
        lambda handle, **on_death: factory(
            handle,
            args.served_model_names or None,
            api_key=args.api_key,
            health_stuck_timeout_s=args.health_stuck_timeout_s,
            chat_template=args.chat_template,
            response_role=args.response_role,
            root_path=args.root_path,
            allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods,
            allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
            disable_log_requests=args.disable_log_requests,
            max_request_body_bytes=args.max_request_body_bytes,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            lora_modules=list(args.lora_modules),
            disable_fastapi_docs=args.disable_fastapi_docs,
            disable_uvicorn_access_log=args.disable_uvicorn_access_log,
            **on_death,
        ),
    )
    try:
        await init_static_loras(app)  # a bad --lora-modules adapter is a start-up error, with its reason

        def core_exited(pid: int) -> None:
            for fd in pidfds:
                try:
                    loop.remove_reader(fd)
                except (ValueError, RuntimeError):
                    pass
            server = app.state.server
            if app.state.core_exit_expected and server is not None:
                server.should_exit = True  # the supervisor is stopping everything: a clean exit
                return
            loop.create_task(app.state.health_monitor.notify_dead(f"the engine core process (pid {pid}) exited"))

        def on_control(message: Control) -> None:  # in the launcher's watch thread
            if message.kind == "stop":
                # The client's own process watch may see the core go before or after this: both end cleanly.
                loop.call_soon_threadsafe(setattr, app.state, "core_exit_expected", True)

        if channel is not None:
            channel.on_control(on_control)
        pidfds = watch_pids(loop, args.core_pids, core_exited)
        sock = socket.socket(fileno=args.listen_fd)
        task = loop.create_task(
            serve_app(
                app,
                sock=sock,
                log_level=args.uvicorn_log_level,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                freeze_gc=freeze_gc,
            )
        )
        while not task.done():
            server = app.state.server
            if server is not None and getattr(server, "started", False):
                break
            await asyncio.sleep(0.02)
        if channel is not None and not task.done():
            channel.ready(FrontendReady(port=sock.getsockname()[1]))
        return await task
    finally:
        await reattacher.stop()
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


def _main(args: FrontendArgs, channel: ChildChannel) -> int:
    from vllm_lite.client.core_client import set_frontend_thread_policy

    set_frontend_thread_policy()
    return asyncio.run(serve(args, channel, freeze_gc=True))


if __name__ == "__main__":
    run_child(FrontendArgs, _main)
