"""The asyncio process client, for ``AsyncLLM``: one receive task per event loop resolves outputs and
utility calls; a heartbeat task keeps an attached core informed; the process fd is watched by the loop."""

from __future__ import annotations

import asyncio
import select
import threading
import time
from typing import Any, Optional

import zmq
import zmq.asyncio

from vllm_lite.client.client_base import AsyncOnlyClient, OutputItem, output_or_raise, running_loop, shut_down_error
from vllm_lite.client.mp_client import MPClientBase
from vllm_lite.config import VllmConfig
from vllm_lite.core.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType


class AsyncMPClient(MPClientBase, AsyncOnlyClient):
    """asyncio client; usable from successive event loops (undelivered outputs carry over)."""

    def __init__(self, vllm_config: Optional[VllmConfig] = None, **kwargs: Any) -> None:
        super().__init__(vllm_config, **kwargs)
        self._in = zmq.asyncio.Socket.from_socket(self._in_sync)
        self._out = zmq.asyncio.Socket.from_socket(self._out_sync)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._outputs: Optional[asyncio.Queue] = None
        self._tasks: list[asyncio.Task] = []

    def _deliver(self, item: OutputItem) -> None:
        if self._outputs is not None:
            self._outputs.put_nowait(item)

    def _ensure_started(self) -> None:
        """Start the receive task (and watchers) on the running loop, once."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        old_queue = self._outputs
        if self._loop is not None:
            # Used from a new event loop (e.g. a second asyncio.run()): the old loop's tasks are
            # gone with it; carry undelivered outputs over and start again here.
            self._tasks = []
            with self._calls_lock:
                self._calls.clear()
            if not self._loop.is_closed():
                self._unwatch_process(self._loop)
        self._loop = loop
        self._outputs = asyncio.Queue()
        self._last_heard = time.monotonic()  # silence counts from now, not from the handshake
        while old_queue is not None and not old_queue.empty():
            self._outputs.put_nowait(old_queue.get_nowait())
        self._tasks.append(loop.create_task(self._receive_loop(), name="core-client-output"))
        if self.heartbeat_interval_s is not None:
            self._tasks.append(loop.create_task(self._heartbeat_loop(), name="core-client-heartbeat"))
        proc_fd = self._process_fd()
        if proc_fd is not None:
            try:
                loop.add_reader(proc_fd, self._on_process_exit)
            except NotImplementedError:  # event loops without add_reader: a thread waits instead
                threading.Thread(
                    target=lambda: (select.select([proc_fd], [], []), loop.call_soon_threadsafe(self._on_process_exit)),
                    daemon=True,
                ).start()

    def _unwatch_process(self, loop: asyncio.AbstractEventLoop) -> None:
        proc_fd = self._process_fd()
        if proc_fd is None:
            return
        try:
            loop.remove_reader(proc_fd)
        except (NotImplementedError, ValueError, RuntimeError):
            pass

    async def _send(self, frames: list[Any]) -> None:
        self._ensure_started()
        await self._in.send_multipart(frames, copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(self._add_frames(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(self._abort_frames(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self._outputs is not None
        return output_or_raise(await self._outputs.get(), self._outputs.put_nowait)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        assert self._loop is not None
        fut = self._loop.create_future()
        call_id, frames = self._utility_frames(fut, method, args)
        try:
            await self._send(frames)
            return await fut
        finally:
            self._forget_call(call_id)

    async def _receive_loop(self) -> None:
        try:
            while self._dead is None:
                self._on_message(await self._out.recv_multipart(copy=False))
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if not self._closed:
                self._set_dead(self._death_message(f"socket error {e}"))

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_interval_s
        while self._dead is None and not self._closed:
            if interval is not None:
                await self._in.send(EngineCoreRequestType.HEARTBEAT.value)
            silence = self._silence_death(time.monotonic())
            if silence is not None:
                self._set_dead(silence)
                return
            await asyncio.sleep(min(interval or 1.0, 1.0))

    def _on_process_exit(self) -> None:
        if self._loop is not None:
            self._unwatch_process(self._loop)
        if self._closed:
            return
        # Let the receive task deliver what the core sent before dying, then fail everyone.
        assert self._loop is not None
        self._loop.call_later(0.1, self._set_dead, self._process_exit_message())

    def shutdown(self) -> None:
        """Stop tasks, close sockets, stop the private core. Safe from inside or outside the loop."""
        if self._closed:
            return
        self._closed = True
        was_dead = self._dead is not None
        err = shut_down_error()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            in_loop = running_loop() is loop
            self._unwatch_process(loop)
            for task in self._tasks:
                if in_loop:
                    task.cancel()
                else:
                    loop.call_soon_threadsafe(task.cancel)
            if in_loop:
                self._set_dead(err, quiet=True)
            elif loop.is_running():
                loop.call_soon_threadsafe(self._set_dead, err, True)
        if self._dead is None:
            self._dead = err
        if not was_dead:
            self._say_goodbye()
        self._in.close()
        self._out.close()
        self._finalizer()
