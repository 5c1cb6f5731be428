"""An HTTP frontend attached to running core(s) that outlives them: the app holds an `EngineHandle`, and on core
death a `Reattacher` says HELLO again every interval until a core answers at the same address(es), then swaps
the new engine in and revives /health. One place for it: `vllm-lite serve`'s frontends (serve_frontend.py) and
`vllm-lite api-server --engine` (api_server.run_server) both build their app through `reattaching_app`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

logger = logging.getLogger("vllm_lite.serve_frontend")


class AttachTarget(Protocol):
    """Where and how to attach (serve_frontend.FrontendArgs is one; `attach_target_for_cli` makes another)."""

    engine: list[str]  # one address per data-parallel core
    auth_token: Optional[str]
    frontend_name: str
    reattach_interval_s: float


@dataclass
class CliAttachTarget:
    """The AttachTarget of `vllm-lite api-server --engine` (serve's frontends get theirs in FrontendArgs)."""

    engine: list[str]
    auth_token: Optional[str] = None
    frontend_name: str = ""
    reattach_interval_s: float = 1.0


def attach_client(args: AttachTarget, **client_kwargs: Any) -> Any:
    """An asyncio engine-core client attached to every core in ``args.engine`` (blocks for the handshake)."""
    from vllm_lite.client.dp_client import make_attached_client

    name = args.frontend_name or f"http-pid{os.getpid()}"
    return make_attached_client(args.engine, args.auth_token, asyncio_mode=True, client_name=name, **client_kwargs)


def build_attached_engine(args: AttachTarget, client: Any = None) -> Any:
    """AsyncLLM attached to every core in ``args.engine`` (several for data parallel), or over ``client``."""
    from vllm_lite.client.async_llm import AsyncLLM
    from vllm_lite.client.llm_engine import attached_frontend_config

    if client is None:
        client = attach_client(args)
    try:
        # serve's --override-generation-config (its FrontendArgs carry it; `api-server --engine` refuses it).
        override = getattr(args, "override_generation_config", None)
        return AsyncLLM(attached_frontend_config(client, override), client=client)
    except BaseException:
        client.shutdown()
        raise


class EngineHandle:
    """What the HTTP app holds instead of the engine: the current AsyncLLM, replaced when this
    frontend re-attaches after a core died (every attribute is the current engine's)."""

    def __init__(self, engine: Any) -> None:
        object.__setattr__(self, "current", engine)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.current, name, value)

    def replace(self, engine: Any) -> Any:
        """Serve ``engine`` from now on; returns the previous one (to shut down)."""
        old = self.current
        object.__setattr__(self, "current", engine)
        return old


class Reattacher:
    """After the engine died: HELLO again every ``interval_s`` until a core answers at the same
    address(es), then swap the new engine into the app (same model only) and revive /health."""

    def __init__(self, args: AttachTarget, handle: EngineHandle, app: Any, interval_s: float) -> None:
        self.args, self.handle, self.app, self.interval_s = args, handle, app, interval_s
        self._task: Optional[asyncio.Task] = None
        self.attempts = 0

    def start(self, reason: str = "") -> None:
        """on_engine_dead: begin re-attaching (once per death)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="frontend-reattach")

    async def stop(self) -> None:
        from vllm_lite.entrypoints.openai.utils import cancel_and_wait

        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        from vllm_lite.client.exceptions import EngineDeadError, EngineHandshakeError

        model = self.handle.model_config.model
        while True:
            await asyncio.sleep(self.interval_s)
            self.attempts += 1
            try:
                # The handshake blocks (sockets, HELLO, READY): off the event loop.
                client = await asyncio.to_thread(attach_client, self.args, handshake_timeout_s=self.interval_s)
            except (EngineHandshakeError, EngineDeadError, OSError) as e:
                logger.debug("re-attach attempt %d failed: %s", self.attempts, e)
                continue
            try:
                # Heartbeats from READY on (the core counts our silence), then the slow part off the loop.
                await client.call_utility_async("ping")
            except Exception as e:  # noqa: BLE001 -- it died again: keep trying
                client.shutdown()
                logger.debug("re-attach attempt %d: the core did not answer: %s", self.attempts, e)
                continue
            try:
                engine = await asyncio.to_thread(build_attached_engine, self.args, client)
            except Exception:  # noqa: BLE001 -- keep trying; the server stays up meanwhile
                logger.exception("re-attach: could not build the engine")
                continue
            if engine.model_config.model != model:
                logger.error(
                    "re-attach: the core now serves %r, not %r: staying unavailable",
                    engine.model_config.model,
                    model,
                )
                engine.shutdown()
                continue
            old = self.handle.replace(engine)
            metrics = getattr(self.app.state, "metrics", None)
            if metrics is not None:
                engine.add_stat_logger(metrics)
            self.app.state.engine_dead = False
            self.app.state.health_monitor.revive()
            logger.warning("re-attached to the engine core after %d attempts", self.attempts)
            try:
                old.shutdown()
            except Exception:  # noqa: BLE001 -- the old engine is dead anyway
                logger.debug("shutting down the dead engine failed", exc_info=True)
            return


def attach_target_for_cli(args: Any) -> AttachTarget:
    """What re-attaching needs from `vllm-lite api-server --engine ADDRESS` flags."""
    from vllm_lite.endpoints import split_addresses

    return CliAttachTarget(
        engine=split_addresses(args.engine, getattr(args, "data_parallel_size", 1)),
        auth_token=getattr(args, "auth_token", None),
    )


def reattaching_app(args: AttachTarget, engine: Any, build: Callable[..., Any]) -> tuple[Any, EngineHandle, Reattacher]:
    """The HTTP app of an attached frontend (`serve`'s children and `api-server --engine` alike): on core death
    it stays up with /health 503 and re-attaches to ``args.engine``.

    ``build(handle, engine_dead_grace_s=..., on_engine_dead=...)`` makes the app (``api_server.build_app`` with
    the caller's other options); the app holds ``handle``, whose engine the re-attacher swaps.
    """
    handle = EngineHandle(engine)
    reattacher: list[Reattacher] = []
    app = build(
        handle,
        engine_dead_grace_s=None,  # stay up: /health says 503 until we re-attach or are stopped
        on_engine_dead=lambda reason: reattacher[0].start(reason) if reattacher else None,
    )
    reattacher.append(Reattacher(args, handle, app, args.reattach_interval_s))
    return app, handle, reattacher[0]


async def attach_app(target: AttachTarget, build: Callable[..., Any]) -> tuple[Any, EngineHandle, Reattacher]:
    """`reattaching_app` over a fresh attachment, never blocking the event loop once the core counts our silence.

    From READY on the core drops a frontend silent for its heartbeat timeout, and the client heartbeats from
    a task on this loop: so the handshake runs in a worker thread, the heartbeat task starts as soon as READY
    is in, and the slow rest (the tokenizer, building the app) runs in worker threads while the loop beats.
    """
    client = await asyncio.to_thread(attach_client, target)
    engine: Any = None
    try:
        await client.call_utility_async("ping")  # starts the client's receive and heartbeat tasks
        engine = await asyncio.to_thread(build_attached_engine, target, client)
        return await asyncio.to_thread(reattaching_app, target, engine, build)
    except BaseException:
        (engine if engine is not None else client).shutdown()
        raise
