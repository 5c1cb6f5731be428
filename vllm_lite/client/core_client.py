"""How a frontend talks to the engine core: in-process, or over ZMQ to a core process.

* ``InprocClient``: the EngineCore lives in this process; ``get_output()`` runs
  one step. For tests and debugging.
* ``SyncMPClient``: starts a private core (``EngineCoreProc``, through
  ``vllm_lite.launcher``) with ``ipc://`` sockets in a private temp dir, or attaches to a running one
  (``addresses=CoreAddresses.from_base(...)``, ``auth_token``), heartbeating as
  the core asks and saying GOODBYE on shutdown. A background thread receives
  outputs into a queue; ``get_output()`` blocks.
* ``AsyncMPClient``: the same over asyncio sockets, for ``AsyncLLM``.

Socket protocol: see ``vllm_lite.core.engine_core_proc``. Engine death (the
process exits -- watched through its launcher fd --, the core says
``engine_dead``, or an attached core goes silent) fails every pending and
future call with ``EngineDeadError`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import secrets
import select
import shutil
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgspec
import torch
import zmq
import zmq.asyncio

from vllm_lite.client.exceptions import EngineDeadError, EngineHandshakeError, EngineStartupError
from vllm_lite import launcher
from vllm_lite.config import VllmConfig, encode_vllm_config
from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreArgs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    HandshakeReply,
    HelloRequest,
    UtilityOutput,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses, private_core_addresses, private_ipc_dir
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0
# An attached core (no process to watch) that says nothing for this long is dead.
DEFAULT_ENGINE_SILENCE_TIMEOUT_S = 30.0

_UTILITY_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def set_frontend_thread_policy() -> None:
    """The frontend does little tensor math; one thread leaves the cores to the model process."""
    torch.set_num_threads(1)


def make_client(
    vllm_config: VllmConfig,
    multiprocess: bool,
    asyncio_mode: bool,
    **kwargs: Any,
) -> "EngineCoreClient":
    """The client for a use: in-process, or a spawned core with a sync or asyncio frontend."""
    if asyncio_mode and not multiprocess:
        raise ValueError("asyncio_mode=True requires multiprocess=True (the in-process client is synchronous).")
    if asyncio_mode:
        return AsyncMPClient(vllm_config, **kwargs)
    if multiprocess:
        return SyncMPClient(vllm_config, **kwargs)
    return InprocClient(vllm_config, **kwargs)


class EngineCoreClient(ABC):
    """The frontend's handle on one engine core."""

    model_facts: dict[str, Any]
    client_index: int

    make_client = staticmethod(make_client)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is synchronous; use AsyncMPClient.")


def _error_output(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=message)


# ---------------------------------------------------------------------------- in-process


class InprocClient(EngineCoreClient):
    """EngineCore in this process, no sockets: ``get_output()`` runs one step."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.engine_core = self._make_engine_core(vllm_config)
        self.model_facts = dict(self.engine_core.model_facts)
        self.client_index = 0
        self._errors: list[EngineCoreOutput] = []

    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        """The engine to drive (a subclass may drive another with EngineCore's interface)."""
        from vllm_lite.core.engine_core import EngineCore

        return EngineCore(vllm_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        try:
            self.engine_core.add_request(request)
        except (ValueError, TypeError) as e:
            # Same contract as the process client: a bad request fails alone, as an output.
            self._errors.append(_error_output(request.request_id, f"{type(e).__name__}: {e}"))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        step = self.engine_core.step() if self.engine_core.has_unfinished_requests() else {}
        outs = step.get(self.client_index) or EngineCoreOutputs()
        if self._errors:
            outs.outputs = self._errors + list(outs.outputs)
            self._errors = []
        return outs

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, list(args))

    def shutdown(self) -> None:
        self.engine_core.shutdown()


# ---------------------------------------------------------------------------- process clients: shared parts


ENGINE_CORE_MODULE = "vllm_lite.core.engine_core_main"


@dataclass
class PrivateCore:
    """A core process started for one frontend: the process, its socket dir, addresses and token."""

    proc: launcher.ChildProcess
    tmpdir: str
    addresses: CoreAddresses
    auth_token: str
    ready: EngineCoreReady


def spawn_private_core(
    vllm_config: VllmConfig,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    module: str = ENGINE_CORE_MODULE,
) -> PrivateCore:
    """Start an engine-core process for this frontend alone (``python -m module``) and wait until it serves.

    A core that fails to start is reaped and its error raised here as EngineStartupError
    carrying the original message (its traceback text on ``__cause__.traceback``).
    """
    tmpdir = private_ipc_dir()  # mode 0700: only we can reach the sockets
    addresses = private_core_addresses(tmpdir)
    token = secrets.token_hex(16)
    args = EngineCoreArgs(
        vllm_config=encode_vllm_config(vllm_config),
        input_address=addresses.input,
        output_address=addresses.output,
        auth_token=token,
        heartbeat_timeout_s=None,  # one frontend, which the launcher watches instead
        drain_timeout_s=0.0,  # nobody is left to read drained outputs
    )
    proc: Optional[launcher.ChildProcess] = None
    try:
        proc = launcher.start_child(module, args, EngineCoreReady, name="engine-core", cleanup_paths=[tmpdir])
        ready = proc.wait_ready(startup_timeout_s)
    except BaseException as e:
        if proc is not None:
            proc.stop(grace_s=1.0)
        shutil.rmtree(tmpdir, ignore_errors=True)
        if isinstance(e, launcher.ChildStartupError):
            raise EngineStartupError(f"Engine core failed to start: {e.exc_type}: {e.message}") from e
        raise
    return PrivateCore(proc, tmpdir, addresses, token, ready)


def _cleanup(
    proc: Optional[launcher.ChildProcess],
    tmpdir: Optional[str],
    sockets: list[zmq.Socket],
    ctx: zmq.Context,
    stop: threading.Event,
    threads: list[threading.Thread],
) -> None:
    """Close a client, also at interpreter exit: its threads first, so none sees the core stop as a death."""
    stop.set()
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=2.0)
    # Then the core: while our sockets are still open it can flush to us and exit at once.
    if proc is not None:
        proc.stop()
    for s in sockets:
        s.close()  # LINGER is 0 unless a GOODBYE is on its way
    ctx.term()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


class _MPClientBase(EngineCoreClient):
    """Spawn-or-attach, sockets, handshake and death bookkeeping shared by the sync and async clients."""

    def __init__(
        self,
        vllm_config: Optional[VllmConfig] = None,
        *,
        addresses: Optional[CoreAddresses] = None,
        auth_token: Optional[str] = None,
        client_name: str = "",
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        engine_silence_timeout_s: float = DEFAULT_ENGINE_SILENCE_TIMEOUT_S,
    ) -> None:
        self.proc: Optional[launcher.ChildProcess] = None
        self.tmpdir: Optional[str] = None
        if addresses is None:
            if vllm_config is None:
                raise ValueError("Pass vllm_config (spawn a private core) or addresses (attach to a running core).")
            if vllm_config.device_config.device.type == "cpu":
                set_frontend_thread_policy()
            core = self._spawn_core(vllm_config, startup_timeout_s)
            self.proc, self.tmpdir, addresses, auth_token = core.proc, core.tmpdir, core.addresses, core.auth_token
        self.addresses = addresses
        self._auth_token = auth_token
        self.engine_silence_timeout_s = engine_silence_timeout_s
        self.identity = uuid.uuid4().bytes
        self._zmq = zmq.Context()
        self._in_sync = self._zmq.socket(zmq.DEALER)
        self._out_sync = self._zmq.socket(zmq.DEALER)
        # Set, and the client's threads joined, before anything else closes (see _cleanup).
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._finalizer = weakref.finalize(
            self, _cleanup, self.proc, self.tmpdir, [self._in_sync, self._out_sync], self._zmq,
            self._stop, self._threads,
        )
        try:
            for sock, addr in ((self._out_sync, addresses.output), (self._in_sync, addresses.input)):
                sock.setsockopt(zmq.IDENTITY, self.identity)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)  # never make the core wait on our receive queue
                sock.connect(addr)
            reply = self._handshake(auth_token, client_name or f"pid{os.getpid()}", handshake_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        self.client_index = reply.client_index
        self.heartbeat_timeout_s = reply.heartbeat_timeout_s
        self.model_facts = {
            "model": reply.model,
            "max_model_len": reply.max_model_len,
            "block_size": reply.block_size,
            "num_gpu_blocks": reply.num_gpu_blocks,
            "vocab_size": reply.vocab_size,
        }
        # Where the core loaded from (an attached frontend builds its tokenizer from these).
        self.model_path = reply.model_path
        self.tokenizer_path = reply.tokenizer
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._call_ids = itertools.count()
        self._dead: Optional[EngineDeadError] = None
        self._closed = False
        self._last_heard = time.monotonic()

    def _spawn_core(self, vllm_config: VllmConfig, startup_timeout_s: float) -> PrivateCore:
        """Start this client's private core (a subclass may start another entry module)."""
        return spawn_private_core(vllm_config, startup_timeout_s)

    def _handshake(self, auth_token: Optional[str], client_name: str, timeout_s: float) -> HandshakeReply:
        hello = HelloRequest(protocol_version=PROTOCOL_VERSION, auth_token=auth_token, client_name=client_name)
        self._in_sync.send_multipart([EngineCoreRequestType.HELLO.value, *MsgpackEncoder().encode(hello)])
        decoder = MsgpackDecoder(HandshakeReply)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and not self.proc.is_alive():
                raise EngineDeadError(f"Engine core exited (code {self.proc.exitcode}) during the handshake.")
            if not self._out_sync.poll(100):
                continue
            frames = self._out_sync.recv_multipart()
            kind = frames[0]
            if kind not in (EngineCoreOutputType.READY.value, EngineCoreOutputType.REFUSED.value):
                continue
            reply: HandshakeReply = decoder.decode(frames[1:])
            if not reply.accepted:
                raise EngineHandshakeError(f"Engine core at {self.addresses.input} refused this frontend: {reply.reason}.")
            return reply
        raise EngineHandshakeError(f"Engine core at {self.addresses.input} did not answer HELLO within {timeout_s:.0f} s.")

    # -------------------------------------------------------------- wire helpers
    def _frames(self, kind: EngineCoreRequestType, obj: Any) -> list[Any]:
        return [kind.value, *self._encoder.encode(obj)]

    def _add_frames(self, request: EngineCoreRequest) -> list[Any]:
        request.client_index = self.client_index
        return self._frames(EngineCoreRequestType.ADD, request)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("This engine core client was shut down.")

    def _death_message(self, why: str) -> EngineDeadError:
        code = f" (exit code {self.proc.exitcode})" if self.proc is not None and self.proc.exitcode is not None else ""
        return EngineDeadError(f"The engine core died{code}: {why}. All pending requests failed.")

    def _decode_message(self, frames: list[Any]) -> Optional[EngineCoreOutputs]:
        """An OUTPUTS message, or None for anything else (heartbeat acks, stray handshake replies)."""
        self._last_heard = time.monotonic()
        if frames[0].bytes != EngineCoreOutputType.OUTPUTS.value:
            return None
        try:
            return self._decoder.decode(frames[1:])
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            logger.error("Dropped an undecodable message from the engine core: %s", e)
            return None

    @staticmethod
    def _utility_result(out: UtilityOutput) -> tuple[Any, Optional[Exception]]:
        if out.failure_message is None:
            return out.result, None
        exc_type = _UTILITY_ERRORS.get(out.failure_type or "", RuntimeError)
        return None, exc_type(out.failure_message)

    @staticmethod
    def _say_goodbye(sock: zmq.Socket) -> None:
        """Attached frontend leaving: the core aborts our requests now, not after a heartbeat timeout."""
        try:
            sock.send(EngineCoreRequestType.GOODBYE.value, zmq.NOBLOCK)
            sock.setsockopt(zmq.LINGER, 500)  # let it leave before the socket closes
        except zmq.ZMQError:
            pass

    @property
    def is_dead(self) -> bool:
        return self._dead is not None


# ---------------------------------------------------------------------------- sync process client


class SyncMPClient(_MPClientBase):
    """Blocking client; a background thread receives outputs and watches the core."""

    def __init__(self, vllm_config: Optional[VllmConfig] = None, **kwargs: Any) -> None:
        super().__init__(vllm_config, **kwargs)
        self._send_lock = threading.Lock()
        self._outputs: queue.Queue[Union[EngineCoreOutputs, Exception]] = queue.Queue()
        self._calls: dict[int, Future] = {}
        self._calls_lock = threading.Lock()
        self._thread = threading.Thread(target=self._receive_loop, name="core-client-output", daemon=True)
        self._threads.append(self._thread)
        self._thread.start()

    def _send(self, frames: list[Any]) -> None:
        self._check_alive()
        with self._send_lock:
            self._in_sync.send_multipart(frames, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(self._add_frames(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(self._frames(EngineCoreRequestType.ABORT, list(request_ids)))

    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        """Next outputs from the core; blocks. Raises EngineDeadError, or TimeoutError after ``timeout``."""
        if self._closed:
            raise EngineDeadError("This engine core client was shut down.")
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"No engine core output within {timeout} s.") from None
        if isinstance(item, Exception):
            self._outputs.put(item)  # every later caller sees it too
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        fut: Future = Future()
        with self._calls_lock:
            self._calls[call_id] = fut
        try:
            self._send(self._frames(EngineCoreRequestType.UTILITY, UtilityRequest(self.client_index, call_id, method, list(args))))
            return fut.result()
        finally:
            with self._calls_lock:
                self._calls.pop(call_id, None)

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out_sync, zmq.POLLIN)
        proc_fd = self.proc.fileno() if self.proc is not None else None
        if proc_fd is not None:
            poller.register(proc_fd, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self._out_sync in events:
                    # Up to a batch of messages, then the checks below (a busy stream must not starve heartbeats).
                    for _ in range(64):
                        self._handle(self._out_sync.recv_multipart(copy=False))
                        if not self._out_sync.poll(0):
                            break
                if self._stop.is_set():
                    return
                if proc_fd is not None and proc_fd in events:
                    # Deliver whatever the core managed to send before it died, then fail everyone.
                    while self._out_sync.poll(50):
                        self._handle(self._out_sync.recv_multipart(copy=False))
                    self._set_dead(self._death_message("the engine core process exited"))
                    return
                now = time.monotonic()
                if self.heartbeat_timeout_s and now >= next_heartbeat:
                    next_heartbeat = now + self.heartbeat_timeout_s / 4
                    with self._send_lock:
                        self._in_sync.send(EngineCoreRequestType.HEARTBEAT.value)
                if self.proc is None and now - self._last_heard > self.engine_silence_timeout_s:
                    self._set_dead(self._death_message(f"no message for {self.engine_silence_timeout_s:.0f} s"))
                    return
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                self._set_dead(self._death_message(f"socket error {e}"))

    def _handle(self, frames: list[Any]) -> None:
        outs = self._decode_message(frames)
        if outs is None:
            return
        if outs.engine_dead:
            self._set_dead(self._death_message("the engine core reported a fatal error"))
            return
        if outs.utility_output is not None:
            with self._calls_lock:
                fut = self._calls.get(outs.utility_output.call_id)
            if fut is not None:
                result, exc = self._utility_result(outs.utility_output)
                fut.set_exception(exc) if exc is not None else fut.set_result(result)
            if not outs.outputs:
                return
        self._outputs.put(outs)

    def _set_dead(self, err: EngineDeadError) -> None:
        if self._dead is not None:
            return
        logger.error("%s", err)
        self._dead = err
        self._outputs.put(err)
        with self._calls_lock:
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(err)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self.proc is None and self._dead is None:
            self._say_goodbye(self._in_sync)
        self._finalizer()
        if self._dead is None:
            self._outputs.put(EngineDeadError("This engine core client was shut down."))


# ---------------------------------------------------------------------------- asyncio process client


class AsyncMPClient(_MPClientBase):
    """asyncio client: one receive task per event loop resolves outputs and utility calls."""

    def __init__(self, vllm_config: Optional[VllmConfig] = None, **kwargs: Any) -> None:
        super().__init__(vllm_config, **kwargs)
        self._in = zmq.asyncio.Socket.from_socket(self._in_sync)
        self._out = zmq.asyncio.Socket.from_socket(self._out_sync)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._outputs: Optional[asyncio.Queue] = None
        self._calls: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

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
            self._calls.clear()
            if self.proc is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(self.proc.fileno())
                except (NotImplementedError, ValueError, RuntimeError):
                    pass
        self._loop = loop
        self._outputs = asyncio.Queue()
        self._last_heard = time.monotonic()  # silence counts from now, not from the handshake
        while old_queue is not None and not old_queue.empty():
            self._outputs.put_nowait(old_queue.get_nowait())
        self._tasks.append(loop.create_task(self._receive_loop(), name="core-client-output"))
        if self.heartbeat_timeout_s or self.proc is None:
            self._tasks.append(loop.create_task(self._heartbeat_loop(), name="core-client-heartbeat"))
        if self.proc is not None:
            proc_fd = self.proc.fileno()
            try:
                loop.add_reader(proc_fd, self._on_process_exit)
            except NotImplementedError:  # event loops without add_reader: a thread waits instead
                threading.Thread(
                    target=lambda: (select.select([proc_fd], [], []),
                                    loop.call_soon_threadsafe(self._on_process_exit)),
                    daemon=True,
                ).start()

    async def _send(self, frames: list[Any]) -> None:
        self._ensure_started()
        await self._in.send_multipart(frames, copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(self._add_frames(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(self._frames(EngineCoreRequestType.ABORT, list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self._outputs is not None
        item = await self._outputs.get()
        if isinstance(item, Exception):
            self._outputs.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        try:
            await self._send(self._frames(EngineCoreRequestType.UTILITY, UtilityRequest(self.client_index, call_id, method, list(args))))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def _receive_loop(self) -> None:
        try:
            while True:
                frames = await self._out.recv_multipart(copy=False)
                outs = self._decode_message(frames)
                if outs is None:
                    continue
                if outs.engine_dead:
                    self._set_dead(self._death_message("the engine core reported a fatal error"))
                    return
                if outs.utility_output is not None:
                    fut = self._calls.get(outs.utility_output.call_id)
                    if fut is not None and not fut.done():
                        result, exc = self._utility_result(outs.utility_output)
                        fut.set_exception(exc) if exc is not None else fut.set_result(result)
                    if not outs.outputs:
                        continue
                assert self._outputs is not None
                self._outputs.put_nowait(outs)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if not self._closed:
                self._set_dead(self._death_message(f"socket error {e}"))

    async def _heartbeat_loop(self) -> None:
        interval = self.heartbeat_timeout_s / 4 if self.heartbeat_timeout_s else 1.0
        while self._dead is None and not self._closed:
            if self.heartbeat_timeout_s:
                await self._in.send(EngineCoreRequestType.HEARTBEAT.value)
            if self.proc is None and time.monotonic() - self._last_heard > self.engine_silence_timeout_s:
                self._set_dead(self._death_message(f"no message for {self.engine_silence_timeout_s:.0f} s"))
                return
            await asyncio.sleep(min(interval, 1.0))

    def _on_process_exit(self) -> None:
        if self._loop is not None and self.proc is not None:
            try:
                self._loop.remove_reader(self.proc.fileno())
            except (NotImplementedError, ValueError, RuntimeError):
                pass
        if self._closed:
            return
        # Let the receive task deliver what the core sent before dying, then fail everyone.
        assert self._loop is not None
        self._loop.call_later(0.1, self._set_dead, self._death_message("the engine core process exited"))

    def _set_dead(self, err: EngineDeadError) -> None:
        if self._dead is not None:
            return
        logger.error("%s", err)
        self._dead = err
        if self._outputs is not None:
            self._outputs.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)

    # The sync API is not available on the asyncio client: it would block the loop.
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError("AsyncMPClient: use await add_request_async().")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError("AsyncMPClient: use await abort_requests_async().")

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("AsyncMPClient: use await get_output_async().")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError("AsyncMPClient: use await call_utility_async().")

    def shutdown(self) -> None:
        """Stop tasks, close sockets, stop the private core. Safe from inside or outside the loop."""
        if self._closed:
            return
        self._closed = True
        err = EngineDeadError("This engine core client was shut down.")
        loop = self._loop
        if loop is not None and not loop.is_closed():
            in_loop = _running_loop() is loop
            if self.proc is not None:
                try:
                    loop.remove_reader(self.proc.fileno())
                except (NotImplementedError, ValueError, RuntimeError):
                    pass
            for task in self._tasks:
                if in_loop:
                    task.cancel()
                else:
                    loop.call_soon_threadsafe(task.cancel)
            if in_loop:
                if self._dead is None:
                    self._set_dead(err)
            elif loop.is_running():
                loop.call_soon_threadsafe(self._set_dead, err)
        if self._dead is None:
            self._dead = err
        if self.proc is None:
            self._say_goodbye(self._in_sync)
        self._in.close()
        self._out.close()
        self._finalizer()


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
