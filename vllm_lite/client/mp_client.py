"""What the sync and asyncio process clients share: everything but their I/O style.

A process client talks to an engine core over two DEALER sockets (protocol: see
``vllm_lite.core.core_sockets``). It either starts a private core (``private_core``) or attaches
to a running one (``addresses=CoreAddresses.from_base(...)``, ``auth_token``), then does the
HELLO/READY handshake, heartbeats as the core asks, and says GOODBYE on shutdown when attached.
Here live the handshake, the frames it sends, decoding and dispatching what the core sends
(outputs, utility results, ``engine_dead``), request-id namespacing, utility-call bookkeeping and
death bookkeeping. The shells (``SyncMPClient``: a receive thread and a queue; ``AsyncMPClient``:
tasks on the running loop) only receive, send and queue.

Engine death fails every pending and future call with ``EngineDeadError`` instead of hanging,
within seconds, however the core went: a private core's process exits (its launcher fd), an
attached core's process on this host exits (a pidfd on the pid its READY named, see
``vllm_lite.process_watch``), the core says ``engine_dead``, or an attached core elsewhere stops
answering the heartbeats we send each second (``engine_silence_timeout_s``, default 4 s: three
missed beats).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from abc import abstractmethod
from typing import Any, Optional

import msgspec
import zmq

from vllm_lite import envs, launcher
from vllm_lite.client.client_base import EngineCoreClient, OutputItem, shut_down_error
from vllm_lite.client.exceptions import EngineDeadError, EngineHandshakeError
from vllm_lite.client.private_core import (
    DEFAULT_STARTUP_TIMEOUT_S,
    PrivateCore,
    set_frontend_thread_policy,
    spawn_private_core,
)
from vllm_lite.client.request_ids import RequestIdNamespace
from vllm_lite.config import VllmConfig
from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestBatch,
    EngineCoreRequestType,
    HandshakeReply,
    HelloRequest,
    StopVerdict,
    UtilityOutput,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.process_watch import ProcessWatch, watch_local_process
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0
# An attached core on another host (no process to watch) that answers no heartbeat for this long is
# dead: three missed beats of HEARTBEAT_INTERVAL_S, and a little slack.
DEFAULT_ENGINE_SILENCE_TIMEOUT_S = 4.0
# An attached core on this host is watched through its process; silence only backs that up (a live
# but wedged process), so it may be long and never mistakes a busy host for a dead core.
LOCAL_ENGINE_SILENCE_TIMEOUT_S = 30.0
# How often an attached frontend heartbeats at most (more often when the core asks for it).
HEARTBEAT_INTERVAL_S = 1.0
# The largest ADD_BATCH message we send: half the smallest input limit a core sets (16 MiB of slack, see
# core_sockets.max_input_message_bytes); a bigger batch goes in parts.
BATCH_MESSAGE_BYTES = 8 << 20

_UTILITY_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def _cleanup(
    proc: Optional[launcher.ChildProcess],
    tmpdir: Optional[str],
    sockets: list[zmq.Socket],
    ctx: zmq.Context,
    stop: threading.Event,
    threads: list[threading.Thread],
    watches: list[ProcessWatch],
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
    for w in watches:
        w.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


class MPClientBase(EngineCoreClient):
    """Spawn-or-attach, sockets, handshake, wire format, dispatch and death bookkeeping.

    A shell implements ``_deliver`` (queue outputs or the error that ended the client) and the
    send/receive loops; utility futures (``concurrent.futures`` or asyncio) are resolved here.
    """

    def __init__(
        self,
        vllm_config: Optional[VllmConfig] = None,
        *,
        addresses: Optional[CoreAddresses] = None,
        auth_token: Optional[str] = None,
        client_name: str = "",
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        engine_silence_timeout_s: Optional[float] = None,
        namespace_request_ids: bool = False,
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
        # Attached to a core that other frontends share: our request ids get a namespace of their own.
        self.namespace = RequestIdNamespace() if namespace_request_ids else None
        self.identity = uuid.uuid4().bytes
        self._zmq = zmq.Context()
        self._in_sync = self._zmq.socket(zmq.DEALER)
        self._out_sync = self._zmq.socket(zmq.DEALER)
        # Set, and the client's threads joined, before anything else closes (see _cleanup).
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[ProcessWatch] = []  # the attached core's process, when on this host
        self._finalizer = weakref.finalize(
            self,
            _cleanup,
            self.proc,
            self.tmpdir,
            [self._in_sync, self._out_sync],
            self._zmq,
            self._stop,
            self._threads,
            self._watches,
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
        self.core_watch: Optional[ProcessWatch] = None
        if self.proc is None:
            self.core_watch = watch_local_process(reply.core_pid, reply.core_host, reply.core_started)
            if self.core_watch is not None:
                self._watches.append(self.core_watch)
        # None: a private core, watched through its launcher fd only.
        self.engine_silence_timeout_s: Optional[float] = None
        if self.proc is None:
            default = DEFAULT_ENGINE_SILENCE_TIMEOUT_S if self.core_watch is None else LOCAL_ENGINE_SILENCE_TIMEOUT_S
            self.engine_silence_timeout_s = default if engine_silence_timeout_s is None else engine_silence_timeout_s
        self.model_facts = {
            "model": reply.model,
            "max_model_len": reply.max_model_len,
            "block_size": reply.block_size,
            "num_gpu_blocks": reply.num_gpu_blocks,
            "vocab_size": reply.vocab_size,
            "max_logprobs": reply.max_logprobs,
            "generation_config": reply.generation_config,
            "runner_type": reply.runner_type,
            "convert_type": reply.convert_type,
            "pooler_config": reply.pooler_config,
            "lora_config": reply.lora_config,
        }
        self.model_path = reply.model_path
        self.tokenizer_path = reply.tokenizer
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._call_ids = itertools.count()
        self._calls: dict[int, Any] = {}  # call id -> future (concurrent or asyncio)
        self._calls_lock = threading.Lock()
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
            if frames[0] not in (EngineCoreOutputType.READY.value, EngineCoreOutputType.REFUSED.value):
                continue
            reply: HandshakeReply = decoder.decode(frames[1:])
            if not reply.accepted:
                raise EngineHandshakeError(
                    f"Engine core at {self.addresses.input} refused this frontend: {reply.reason}."
                )
            return reply
        raise EngineHandshakeError(
            f"Engine core at {self.addresses.input} did not answer HELLO within {timeout_s:.0f} s."
        )

    # -------------------------------------------------------------- what we send
    def _frames(self, kind: EngineCoreRequestType, obj: Any) -> list[Any]:
        return [kind.value, *self._encoder.encode(obj)]

    def _add_frames(self, request: EngineCoreRequest) -> list[Any]:
        if self.namespace is not None:
            request = self.namespace.request(request)
        request.client_index = self.client_index
        return self._frames(EngineCoreRequestType.ADD, request)

    def _add_batch_messages(self, requests: list[EngineCoreRequest]) -> list[list[Any]]:
        """The ADD_BATCH messages of ``requests``: one, or parts that each fit the core's size limit."""
        if self.namespace is not None:
            requests = [self.namespace.request(r) for r in requests]
        for request in requests:
            request.client_index = self.client_index
        configured = int(envs.VLLM_LITE_MAX_MESSAGE_BYTES)
        limit = min(BATCH_MESSAGE_BYTES, configured // 2) if configured > 0 else BATCH_MESSAGE_BYTES
        parts: list[list[Any]] = []
        self._split_batch(requests, limit, parts)
        # Every part but the last says more are coming (the core holds its steps until the last).
        last = EngineCoreRequestBatch(parts[-1][0].requests, more=False)
        parts[-1] = [last, self._frames(EngineCoreRequestType.ADD_BATCH, last)]
        return [frames for _, frames in parts]

    def _split_batch(self, requests: list[EngineCoreRequest], limit: int, out: list[list[Any]]) -> None:
        """Append ``[batch, frames]`` for ``requests`` if they fit ``limit`` (or are one), else for each half."""
        batch = EngineCoreRequestBatch(requests, more=True)
        frames = self._frames(EngineCoreRequestType.ADD_BATCH, batch)
        if len(requests) > 1 and sum(len(f) for f in frames[1:]) > limit:
            half = len(requests) // 2
            self._split_batch(requests[:half], limit, out)
            self._split_batch(requests[half:], limit, out)
            return
        out.append([batch, frames])

    def _abort_frames(self, request_ids: list[str]) -> list[Any]:
        ids = self.namespace.ids(request_ids) if self.namespace is not None else list(request_ids)
        return self._frames(EngineCoreRequestType.ABORT, ids)

    def _stop_verdict_frames(self, step: int, stopped: list[str]) -> list[Any]:
        ids = self.namespace.ids(stopped) if self.namespace is not None else list(stopped)
        return self._frames(EngineCoreRequestType.STOP_VERDICT, StopVerdict(step, ids))

    def _utility_frames(self, fut: Any, method: str, args: tuple[Any, ...]) -> tuple[int, list[Any]]:
        """Book ``fut`` for a new utility call; returns its id and the frames to send."""
        call_id = next(self._call_ids)
        with self._calls_lock:
            self._calls[call_id] = fut
        return call_id, self._frames(
            EngineCoreRequestType.UTILITY, UtilityRequest(self.client_index, call_id, method, list(args))
        )

    def _forget_call(self, call_id: int) -> None:
        with self._calls_lock:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise shut_down_error()

    # -------------------------------------------------------------- what we receive
    def _on_message(self, frames: list[Any]) -> None:
        """Dispatch one message from the core: outputs to the queue, utility results to their callers."""
        outs = self._decode_message(frames)
        if outs is None:
            return
        if outs.engine_dead:
            self._set_dead(self._death_message("the engine core reported a fatal error"))
            return
        if outs.utility_output is not None:
            self._resolve_call(outs.utility_output)
            if not outs.outputs:
                return
        if self.namespace is not None:
            self.namespace.strip(outs)
        self._deliver(outs)

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

    def _resolve_call(self, out: UtilityOutput) -> None:
        with self._calls_lock:
            fut = self._calls.get(out.call_id)
        if fut is None or fut.done():
            return
        if out.failure_message is None:
            fut.set_result(out.result)
        else:
            fut.set_exception(_UTILITY_ERRORS.get(out.failure_type or "", RuntimeError)(out.failure_message))

    @abstractmethod
    def _deliver(self, item: OutputItem) -> None:
        """Queue outputs (or the error that ended this client) for ``get_output``."""

    # -------------------------------------------------------------- liveness and death
    @property
    def heartbeat_interval_s(self) -> Optional[float]:
        """How often to heartbeat, or None (a private core that asks for none).

        An attached frontend beats every second at most, so that the answers prove the core alive
        (three missed ones mean death); faster when the core's own timeout or ours is shorter."""
        intervals = [self.heartbeat_timeout_s / 4] if self.heartbeat_timeout_s else []
        if self.engine_silence_timeout_s is not None:
            intervals += [HEARTBEAT_INTERVAL_S, self.engine_silence_timeout_s / 3]
        return min(intervals) if intervals else None

    def _process_fd(self) -> Optional[int]:
        """An fd readable once the core's process exits (launcher fd or pidfd), or None."""
        if self.proc is not None:
            return self.proc.fileno()
        return self.core_watch.fd if self.core_watch is not None else None

    def _silence_death(self, now: float) -> Optional[EngineDeadError]:
        """An attached core that answers no heartbeat for too long (or whose process, polled where
        no pidfd exists, is gone) is dead."""
        if self.core_watch is not None and self.core_watch.fd is None and self.core_watch.gone():
            return self._death_message(f"the engine core process (pid {self.core_watch.pid}) exited")
        timeout = self.engine_silence_timeout_s
        if timeout is not None and now - self._last_heard > timeout:
            return self._death_message(f"no message for {timeout:.0f} s")
        return None

    def _process_exit_message(self) -> EngineDeadError:
        pid = self.proc.pid if self.proc is not None else self.core_watch.pid if self.core_watch is not None else 0
        return self._death_message(f"the engine core process (pid {pid}) exited")

    def _death_message(self, why: str) -> EngineDeadError:
        code = f" (exit code {self.proc.exitcode})" if self.proc is not None and self.proc.exitcode is not None else ""
        return EngineDeadError(f"The engine core died{code}: {why}. All pending requests failed.")

    def _set_dead(self, err: EngineDeadError, quiet: bool = False) -> None:
        """Fail the output stream and every pending utility call, once (``quiet``: a shutdown, not a death)."""
        if self._dead is not None:
            return
        if not quiet:
            logger.error("%s", err)
        self._dead = err
        self._deliver(err)
        with self._calls_lock:
            pending = list(self._calls.values())
        for fut in pending:
            if not fut.done():
                fut.set_exception(err)

    def _say_goodbye(self) -> None:
        """Attached frontend leaving: the core aborts our requests now, not after a heartbeat timeout."""
        if self.proc is not None:
            return  # a private core stops with us
        try:
            self._in_sync.send(EngineCoreRequestType.GOODBYE.value, zmq.NOBLOCK)
            self._in_sync.setsockopt(zmq.LINGER, 500)  # let it leave before the socket closes
        except zmq.ZMQError:
            pass

    @property
    def is_dead(self) -> bool:
        return self._dead is not None
