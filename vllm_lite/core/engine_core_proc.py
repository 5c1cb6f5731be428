"""The engine core in its own process, serving frontends over ZMQ.

Sockets (the core always binds, frontends connect):

* ``input``  ROUTER. A frontend connects a DEALER with a fixed identity and sends
  ``[type, *payload]`` where ``type`` is one ``EngineCoreRequestType`` byte:
  HELLO(HelloRequest), ADD(EngineCoreRequest), ABORT(list[str]),
  UTILITY(UtilityRequest), HEARTBEAT(no payload), GOODBYE(no payload: detach now).
* ``output`` ROUTER. The same frontend connects a second DEALER with the *same*
  identity; the core sends it ``[type, *payload]`` where ``type`` is one
  ``EngineCoreOutputType`` byte: READY/REFUSED(HandshakeReply),
  OUTPUTS(EngineCoreOutputs), HEARTBEAT(no payload).

Two sockets because a ZMQ socket belongs to one thread: the input thread owns
``input`` and the output thread owns ``output``, so decoding and encoding
overlap with the model step. Routing is by identity: the core keeps
identity -> client index from the handshake, overwrites every request's
``client_index`` with the sender's (a frontend cannot receive another's
outputs), and sends each client only its own outputs. A frontend must HELLO
before anything else; messages from unknown identities are dropped.

Threads and the busy loop:

* input thread: recv -> typed decode -> input queue. A malformed or wrong-typed
  message is dropped with a log line; it never reaches the loop. HEARTBEATs are
  answered right here (straight onto the output queue), so a long model step
  does not look like a dead core.
* busy loop (main thread): drain the input queue (HELLOs, then ABORTs -- the fast
  path -- then ADDs and UTILITY calls in arrival order), ``step()``, route outputs
  per client; block on the input queue when idle.
* output thread: output queue -> encode -> send.

Lifecycle: SIGTERM stops new work, drains running requests for at most
``drain_timeout_s``, aborts the rest and exits 0. A fatal error in the loop sends
``EngineCoreOutputs(engine_dead=True)`` to every frontend and exits 1. A
frontend silent for longer than ``heartbeat_timeout_s`` (any message counts) is
dropped and its requests aborted (with ABORT outputs sent to it, in case it was
only slow; if it speaks again it is taken back). GOODBYE detaches at once.
Sockets are bound before the model loads, so a busy address fails at once.

The process is started by ``vllm_lite.launcher`` (``python -m vllm_lite.core.engine_core_main``,
arguments ``EngineCoreArgs``); ``run_engine_core`` answers ``EngineCoreReady`` or the start-up
error with its traceback, and the launcher ends the process when its parent dies.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import zmq

from vllm_lite.config import VllmConfig, decode_vllm_config
from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreArgs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreReady,
    EngineCoreRequestType,
    FinishReason,
    HandshakeReply,
    HelloRequest,
    UtilityOutput,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder

if TYPE_CHECKING:
    from vllm_lite.launcher import ChildChannel

logger = logging.getLogger(__name__)

# How often the idle loop wakes to check heartbeats, the parent and signals.
_IDLE_POLL_S = 0.2
# How many dropped frontends the core remembers (to take them back if they were only slow).
_MAX_REMEMBERED_DROPPED = 1024
# How long the output thread retries a READY for a frontend whose output DEALER is still connecting.
_READY_RETRY_S = 5.0


@dataclass
class CoreProcOptions:
    """Knobs of the serving process (not of the model)."""

    # None: any frontend may attach. Else HELLO must carry this token.
    auth_token: Optional[str] = None
    # Drop a frontend (abort its requests) after this much silence; None or 0: never.
    heartbeat_timeout_s: Optional[float] = 10.0
    # On SIGTERM, let running requests finish for at most this long.
    drain_timeout_s: float = 30.0
    # SIGINT too stops the core (daemon). A private core ignores it: its parent decides.
    handle_sigint: bool = False
    # Listening sockets a parent bound for us (input, output): served on instead of binding again.
    input_fd: Optional[int] = None
    output_fd: Optional[int] = None


def set_core_thread_policy(vllm_config: VllmConfig) -> int:
    """Set torch intra-op threads for the engine core process and return the number.

    DeviceConfig.num_threads wins. Otherwise, on CPU the core takes every core
    it may run on but one, which stays free for the frontend(s): measured here,
    OpenMP threads that must share a core with a busy process run decode-sized
    matmuls 2-20x slower than one thread that has its core alone (on 2 cores,
    1 thread gave 150 output tok/s where 2 gave 41 on the throughput benchmark).
    With an accelerator the CPU does little math, so 1 thread.
    """
    n = vllm_config.device_config.num_threads
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_threads must be a positive integer, got {n!r}.")
    elif vllm_config.device_config.device.type == "cpu":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        n = max(1, cores - 1)
    else:
        n = 1
    torch.set_num_threads(n)
    return n


class _LogLimiter:
    """At most ``burst`` warnings per ``window_s``: a peer spraying junk must not flood the log."""

    def __init__(self, burst: int = 20, window_s: float = 60.0) -> None:
        self.burst, self.window_s = burst, window_s
        self.window_start, self.count, self.suppressed = 0.0, 0, 0

    def warn(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.window_start > self.window_s:
            if self.suppressed:
                logger.warning("(%d similar messages suppressed)", self.suppressed)
            self.window_start, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count <= self.burst:
            logger.warning(msg, *args)
        else:
            self.suppressed += 1


class _Client:
    """One attached frontend, as the busy loop sees it."""

    __slots__ = ("identity", "index", "name", "request_ids")

    def __init__(self, identity: bytes, index: int, name: str) -> None:
        self.identity = identity
        self.index = index
        self.name = name
        self.request_ids: set[str] = set()


# Items on the input queue: (identity, request type, decoded payload).
_InputItem = tuple[bytes, EngineCoreRequestType, Any]
# Items on the output queue: (identity, output type, struct or None), or None to stop.
_OutputItem = Optional[tuple[bytes, EngineCoreOutputType, Any]]


class EngineCoreProc:
    """Wraps an EngineCore with sockets, threads and the busy loop (see module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        addresses: CoreAddresses,
        options: Optional[CoreProcOptions] = None,
    ) -> None:
        self.options = options or CoreProcOptions()
        self.addresses = addresses
        self.num_threads = set_core_thread_policy(vllm_config)
        self._model_path = vllm_config.model_config.model
        self._tokenizer = vllm_config.model_config.tokenizer

        self.input_queue: queue.Queue[_InputItem] = queue.Queue()
        self.output_queue: queue.Queue[_OutputItem] = queue.Queue()
        self._clients: dict[bytes, _Client] = {}
        self._clients_by_index: dict[int, _Client] = {}
        self._next_client_index = 0
        self._owner: dict[str, _Client] = {}  # live request id -> its frontend
        # Frontends dropped for silence, identity -> name: taken back if they speak again.
        self._dropped: OrderedDict[bytes, str] = OrderedDict()
        self._last_seen: dict[bytes, float] = {}  # written by the input thread
        self._stop_threads = threading.Event()
        self._sigterm = False
        self._drain_deadline: Optional[float] = None
        self._last_housekeeping = 0.0
        self._drop_log = _LogLimiter()  # shared by the input thread and the loop; races only miscount

        self._zmq = zmq.Context()
        ready = [threading.Event(), threading.Event()]
        errors: list[BaseException] = []
        self._input_thread = threading.Thread(
            target=self._input_thread_main, args=(ready[0], errors), name="core-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_thread_main, args=(ready[1], errors), name="core-output", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()
        for ev in ready:
            ev.wait(10.0)
        if errors or not all(ev.is_set() for ev in ready):
            self._stop_socket_threads()
            raise RuntimeError(f"Engine core could not bind its sockets {addresses}: {errors[0] if errors else 'timeout'}")
        # Sockets first (a busy port fails in milliseconds, not after loading the model); frontends
        # that connect meanwhile wait in the input queue until the loop starts.
        try:
            self.engine_core = self._make_engine_core(vllm_config)
            self.model_facts: dict[str, Any] = dict(self.engine_core.model_facts)
        except BaseException:
            self._stop_socket_threads()
            raise

    def _stop_socket_threads(self) -> None:
        self.output_queue.put(None)
        self._output_thread.join(timeout=5.0)
        self._stop_threads.set()
        self._input_thread.join(timeout=2.0)
        self._zmq.term()

    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        """The engine this process serves (a subclass may serve another with EngineCore's interface)."""
        from vllm_lite.core.engine_core import EngineCore

        return EngineCore(vllm_config)

    def ready_message(self, vllm_config: VllmConfig) -> EngineCoreReady:
        """What the launcher tells our parent once we serve."""
        import vllm_lite

        facts = self.model_facts
        return EngineCoreReady(
            model=str(facts.get("model", "")), model_path=self._model_path, tokenizer=self._tokenizer,
            max_model_len=int(facts.get("max_model_len", 0)), block_size=int(facts.get("block_size", 0)),
            num_gpu_blocks=int(facts.get("num_gpu_blocks", 0)),
            num_cpu_blocks=int(vllm_config.cache_config.num_cpu_blocks or 0),
            vocab_size=int(facts.get("vocab_size", 0)),
            vllm_lite_version=str(vllm_lite.__version__), torch_version=str(torch.__version__),
        )

    def install_signal_handlers(self) -> None:
        """SIGTERM (and SIGINT for a daemon): stop taking work, drain, exit 0. Main thread only."""

        def on_term(signum: int, frame: Any) -> None:
            self._sigterm = True

        signal.signal(signal.SIGTERM, on_term)
        if self.options.handle_sigint:
            signal.signal(signal.SIGINT, on_term)

    def request_shutdown(self) -> None:
        """Same as SIGTERM, callable from any thread (tests, an embedding server)."""
        self._sigterm = True

    # ------------------------------------------------------------------ busy loop
    def run_busy_loop(self) -> int:
        """Serve until told to stop; return the process exit code (0 clean, 1 fatal)."""
        try:
            while True:
                self._process_input(block=not self.engine_core.has_unfinished_requests())
                self._housekeeping()
                if self._sigterm:
                    if self._drain_deadline is None:
                        logger.info("Shutdown requested: draining running requests for up to %.1f s.",
                                    self.options.drain_timeout_s)
                        self._drain_deadline = time.monotonic() + self.options.drain_timeout_s
                    if not self.engine_core.has_unfinished_requests():
                        break
                    if time.monotonic() >= self._drain_deadline:
                        self._abort_all("the engine core shut down before the request finished")
                        break
                if self.engine_core.has_unfinished_requests():
                    self._route_outputs(self.engine_core.step())
        except BaseException:  # noqa: BLE001 -- any failure here kills the engine, loudly
            logger.error("Fatal error in the engine core busy loop:\n%s", traceback.format_exc())
            self._close(dead=True)
            return 1
        self._close(dead=False)
        return 0

    def _process_input(self, block: bool) -> None:
        items: list[_InputItem] = []
        if block:
            try:
                items.append(self.input_queue.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return
        while True:
            try:
                items.append(self.input_queue.get_nowait())
            except queue.Empty:
                break
        if not items:
            return
        # Requests that an ABORT later in this batch cancels: never add them.
        aborted_after: dict[str, int] = {}
        for pos, (identity, kind, payload) in enumerate(items):
            if kind is EngineCoreRequestType.HELLO:
                self._handle_hello(identity, payload)
            elif kind is EngineCoreRequestType.HEARTBEAT:
                if self._client(identity, "HEARTBEAT") is not None:
                    self.output_queue.put((identity, EngineCoreOutputType.HEARTBEAT, None))
            elif kind is EngineCoreRequestType.ABORT:
                for rid in payload:
                    aborted_after[rid] = pos
        for identity, kind, payload in items:
            if kind is EngineCoreRequestType.ABORT:
                self._handle_abort(identity, payload)
        for pos, (identity, kind, payload) in enumerate(items):
            if kind is EngineCoreRequestType.ADD:
                if aborted_after.get(payload.request_id, -1) > pos:
                    continue
                self._handle_add(identity, payload)
            elif kind is EngineCoreRequestType.UTILITY:
                self._handle_utility(identity, payload)
        for identity, kind, _ in items:
            if kind is EngineCoreRequestType.GOODBYE:
                client = self._clients.get(identity)
                if client is not None:
                    self._drop_client(client, "it said GOODBYE", may_return=False)

    def _client(self, identity: bytes, what: str) -> Optional[_Client]:
        client = self._clients.get(identity)
        if client is None and identity in self._dropped:
            # Dropped for silence but alive after all (e.g. its event loop started late): it proved
            # its token at HELLO, so take it back. Its old requests already ended with ABORT outputs.
            client = self._register(identity, self._dropped.pop(identity))
            logger.info("Frontend %r came back; re-attached as client %d.", client.name, client.index)
        if client is None:
            self._drop_log.warn("Dropped %s from frontend %s that has not said HELLO.", what, identity.hex())
        return client

    def _register(self, identity: bytes, name: str) -> _Client:
        client = _Client(identity, self._next_client_index, name)
        self._next_client_index += 1
        self._clients[identity] = client
        self._clients_by_index[client.index] = client
        self._last_seen[identity] = time.monotonic()
        return client

    def _handle_hello(self, identity: bytes, hello: HelloRequest) -> None:
        reason = None
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (f"protocol version mismatch: frontend speaks {hello.protocol_version}, "
                      f"engine core speaks {PROTOCOL_VERSION}")
        elif self.options.auth_token is not None and not hmac.compare_digest(
            (hello.auth_token or "").encode(), self.options.auth_token.encode()
        ):
            reason = "wrong auth token"
        elif self._sigterm:
            reason = "engine core is shutting down"
        if reason is not None:
            logger.warning("Refused frontend %r (%s): %s.", hello.client_name, identity.hex(), reason)
            self.output_queue.put((identity, EngineCoreOutputType.REFUSED, HandshakeReply(accepted=False, reason=reason)))
            return
        client = self._clients.get(identity)
        if client is None:
            self._dropped.pop(identity, None)
            client = self._register(identity, hello.client_name)
            logger.info("Frontend %r attached as client %d.", hello.client_name, client.index)
        self._last_seen[identity] = time.monotonic()
        facts = self.model_facts
        reply = HandshakeReply(
            accepted=True,
            client_index=client.index,
            model=str(facts.get("model", "")),
            max_model_len=int(facts.get("max_model_len", 0)),
            block_size=int(facts.get("block_size", 0)),
            num_gpu_blocks=int(facts.get("num_gpu_blocks", 0)),
            vocab_size=int(facts.get("vocab_size", 0)),
            heartbeat_timeout_s=float(self.options.heartbeat_timeout_s or 0.0),
            model_path=self._model_path,
            tokenizer=self._tokenizer,
        )
        self.output_queue.put((identity, EngineCoreOutputType.READY, reply))

    def _handle_abort(self, identity: bytes, request_ids: list[str]) -> None:
        client = self._client(identity, "ABORT")
        if client is None:
            return
        # A frontend may only abort its own requests.
        mine = [rid for rid in request_ids if self._owner.get(rid) is client]
        if mine:
            self.engine_core.abort_requests(mine)
            for rid in mine:
                del self._owner[rid]
                client.request_ids.discard(rid)

    def _handle_add(self, identity: bytes, request: EngineCoreRequest) -> None:
        client = self._client(identity, f"ADD {request.request_id!r}")
        if client is None:
            return
        rid = request.request_id
        if self._sigterm:
            return self._reject(client, rid, "the engine core is shutting down and takes no new requests")
        if rid in self._owner:
            return self._reject(client, rid, f"duplicate request id {rid!r}: a request with this id is still running")
        request.client_index = client.index
        try:
            self.engine_core.add_request(request)
        except (ValueError, TypeError) as e:
            return self._reject(client, rid, f"{type(e).__name__}: {e}")
        self._owner[rid] = client
        client.request_ids.add(rid)

    def _reject(self, client: _Client, request_id: str, message: str) -> None:
        logger.warning("Request %r from client %d failed: %s", request_id, client.index, message)
        out = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=message)
        self.output_queue.put((client.identity, EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(outputs=[out])))

    def _handle_utility(self, identity: bytes, call: UtilityRequest) -> None:
        client = self._client(identity, f"UTILITY {call.method!r}")
        if client is None:
            return
        try:
            if call.method == "list_frontends":  # the serving process's own facts, not the engine's
                value: Any = [{"client_index": c.index, "name": c.name, "num_requests": len(c.request_ids)}
                              for c in self._clients.values()]
            else:
                value = self.engine_core.call_utility(call.method, list(call.args))
            result = UtilityOutput(call.call_id, result=value)
        except Exception as e:  # noqa: BLE001 -- a failed utility call fails only that call
            result = UtilityOutput(call.call_id, failure_message=str(e), failure_type=type(e).__name__)
        self.output_queue.put((identity, EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(utility_output=result)))

    def _route_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for index, outs in outputs.items():
            client = self._clients_by_index.get(index)
            for out in outs.outputs:
                if out.finish_reason is not None:
                    owner = self._owner.pop(out.request_id, None)
                    if owner is not None:
                        owner.request_ids.discard(out.request_id)
            if client is None:
                continue  # that frontend has left; its requests were aborted
            self.output_queue.put((client.identity, EngineCoreOutputType.OUTPUTS, outs))

    def _abort_all(self, message: str) -> None:
        """Abort every live request, telling each frontend which of its requests ended."""
        for client in list(self._clients.values()):
            ids = sorted(client.request_ids)
            if not ids:
                continue
            self.engine_core.abort_requests(ids)
            outs = [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT, error=message) for rid in ids]
            self.output_queue.put((client.identity, EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(outputs=outs)))
            client.request_ids.clear()
        self._owner.clear()

    def _housekeeping(self) -> None:
        """At most a few times a second: socket threads alive? frontends alive?"""
        now = time.monotonic()
        if now - self._last_housekeeping < _IDLE_POLL_S:
            return
        self._last_housekeeping = now
        if not (self._input_thread.is_alive() and self._output_thread.is_alive()):
            raise RuntimeError("an engine core socket thread died (see its traceback above)")
        timeout = self.options.heartbeat_timeout_s
        if not timeout:
            return
        for client in list(self._clients.values()):
            silent = now - self._last_seen.get(client.identity, now)
            if silent > timeout:
                self._drop_client(client, f"silent for {silent:.1f} s (heartbeat timeout {timeout} s)")

    def _drop_client(self, client: _Client, why: str, may_return: bool = True) -> None:
        logger.warning("Dropping frontend %r (client %d): %s; aborting its %d requests.",
                       client.name, client.index, why, len(client.request_ids))
        if client.request_ids:
            ids = sorted(client.request_ids)
            self.engine_core.abort_requests(ids)
            for rid in ids:
                self._owner.pop(rid, None)
            # If it is alive after all, it learns why its requests ended instead of waiting forever.
            message = f"aborted by the engine core: this frontend was dropped ({why})"
            outs = [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT, error=message) for rid in ids]
            self.output_queue.put((client.identity, EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(outputs=outs)))
        del self._clients[client.identity]
        del self._clients_by_index[client.index]
        self._last_seen.pop(client.identity, None)
        if may_return:
            self._dropped[client.identity] = client.name
            while len(self._dropped) > _MAX_REMEMBERED_DROPPED:
                self._dropped.popitem(last=False)

    # ------------------------------------------------------------------ shutdown
    def _close(self, dead: bool) -> None:
        if dead:
            for client in list(self._clients.values()):
                self.output_queue.put((client.identity, EngineCoreOutputType.OUTPUTS, EngineCoreOutputs(engine_dead=True)))
        # The output thread flushes everything queued before the stop marker, then stops.
        self._stop_socket_threads()
        try:
            self.engine_core.shutdown()
        except Exception:  # noqa: BLE001 -- we are exiting anyway
            logger.exception("EngineCore.shutdown() failed.")

    # ------------------------------------------------------------------ socket threads
    def _bind(self, address: str, linger: int, mandatory: bool = False, sndhwm: Optional[int] = None,
              fd: Optional[int] = None) -> zmq.Socket:
        """A bound ROUTER socket, or an exception with nothing left open (so the context can terminate).

        ``fd``: a listening socket our parent already bound to ``address`` (no bind-and-release race)."""
        sock = self._zmq.socket(zmq.ROUTER)
        try:
            if fd is not None:
                sock.setsockopt(zmq.USE_FD, fd)
            sock.setsockopt(zmq.LINGER, linger)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if mandatory:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if sndhwm is not None:
                sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.bind(address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _input_thread_main(self, ready: threading.Event, errors: list[BaseException]) -> None:
        try:
            sock = self._bind(self.addresses.input, linger=0, fd=self.options.input_fd)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            ready.set()
            return
        ready.set()
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
            EngineCoreRequestType.HELLO: MsgpackDecoder(HelloRequest),
        }
        heartbeat = EngineCoreRequestType.HEARTBEAT
        goodbye = EngineCoreRequestType.GOODBYE
        try:
            while not self._stop_threads.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                identity = frames[0].bytes
                try:
                    if len(frames) < 2:
                        raise ValueError("message has no type frame")
                    kind = EngineCoreRequestType(frames[1].bytes)
                    if kind is heartbeat or kind is goodbye:
                        payload = None
                    else:
                        if len(frames) < 3:
                            raise ValueError(f"{kind.name} message has no payload")
                        payload = decoders[kind].decode(frames[2:])
                except Exception as e:  # noqa: BLE001 -- whatever a peer sends, it never kills the core
                    self._drop_log.warn("Dropped malformed message from %s: %s", identity.hex(), e)
                    continue
                if identity in self._clients:  # attached: tracked, and heartbeats answered right here
                    self._last_seen[identity] = time.monotonic()
                    if kind is heartbeat:
                        self.output_queue.put((identity, EngineCoreOutputType.HEARTBEAT, None))
                        continue
                # Everything else goes to the loop, which also decides about unknown frontends.
                self.input_queue.put((identity, kind, payload))
        finally:
            sock.close(linger=0)

    def _output_thread_main(self, ready: threading.Event, errors: list[BaseException]) -> None:
        try:
            # No send limit: with ROUTER_MANDATORY a full pipe would block every frontend's outputs
            # behind one slow reader (a reader that stops altogether is dropped by the heartbeat watch).
            sock = self._bind(self.addresses.output, linger=2000, mandatory=True, sndhwm=0, fd=self.options.output_fd)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            ready.set()
            return
        ready.set()
        encoder = MsgpackEncoder()
        # Handshake replies to a frontend whose output DEALER is still connecting: (frames, give-up time).
        pending: list[tuple[list[Any], float]] = []
        unreachable: set[bytes] = set()  # frontends we already logged as gone (log once, not per step)
        try:
            while True:
                try:
                    item = self.output_queue.get(timeout=0.01) if pending else self.output_queue.get()
                except queue.Empty:
                    item = _NOTHING
                if pending:
                    pending = [p for p in pending if not self._try_send(sock, p[0], p[1], unreachable)]
                if item is _NOTHING:
                    continue
                if item is None:
                    break
                identity, kind, obj = item
                try:
                    frames = [identity, kind.value, *encoder.encode(obj)] if obj is not None else [identity, kind.value]
                except (TypeError, ValueError, OverflowError) as e:
                    frames = self._encode_failure(encoder, identity, kind, obj, e)
                    if frames is None:
                        continue
                is_handshake = kind in (EngineCoreOutputType.READY, EngineCoreOutputType.REFUSED)
                give_up = time.monotonic() + (_READY_RETRY_S if is_handshake else 0.0)
                if not self._try_send(sock, frames, give_up, unreachable):
                    pending.append((frames, give_up))
        finally:
            sock.close()

    @staticmethod
    def _encode_failure(encoder: MsgpackEncoder, identity: bytes, kind: EngineCoreOutputType, obj: Any,
                        e: Exception) -> Optional[list[Any]]:
        """A utility result that msgpack cannot carry fails that call, not the core."""
        util = getattr(obj, "utility_output", None)
        if util is not None:
            failed = UtilityOutput(util.call_id, failure_message=f"result cannot be sent: {e}", failure_type="TypeError")
            return [identity, kind.value, *encoder.encode(EngineCoreOutputs(utility_output=failed))]
        logger.error("Could not encode outputs for %s: %s", identity.hex(), e)
        return None

    @staticmethod
    def _try_send(sock: zmq.Socket, frames: list[Any], give_up: float, unreachable: set[bytes]) -> bool:
        """True when sent or given up; False to retry later (frontend's output DEALER not connected yet)."""
        try:
            sock.send_multipart(frames, copy=False)
            unreachable.discard(frames[0])
            return True
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            if time.monotonic() >= give_up:
                if frames[0] not in unreachable:
                    unreachable.add(frames[0])
                    logger.warning("Frontend %s is unreachable: dropping its messages.", bytes(frames[0]).hex())
                return True
            return False


_NOTHING = object()


def run_engine_core(args: EngineCoreArgs, channel: "ChildChannel", proc_cls: type = EngineCoreProc) -> int:
    """An engine-core process's life: build the core, answer ready (or the start-up error), serve.

    Returns the exit code (0 clean, 1 fatal); ``launcher.run_child`` exits with it.
    """
    stop_early = {"flag": False}

    def early_term(signum: int, frame: Any) -> None:
        stop_early["flag"] = True
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, early_term)
    if not args.handle_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    options = CoreProcOptions(
        auth_token=args.auth_token, heartbeat_timeout_s=args.heartbeat_timeout_s,
        drain_timeout_s=args.drain_timeout_s, handle_sigint=args.handle_sigint,
        input_fd=args.input_fd, output_fd=args.output_fd,
    )
    try:
        vllm_config = decode_vllm_config(args.vllm_config)
        proc = proc_cls(vllm_config, CoreAddresses(args.input_address, args.output_address), options)
    except BaseException as e:  # noqa: BLE001 -- every start-up failure goes to the parent
        if isinstance(e, SystemExit) and stop_early["flag"]:
            return 0
        logger.error("Engine core failed to start:\n%s", traceback.format_exc())
        channel.failed(e)
        return 1
    proc.install_signal_handlers()
    channel.ready(proc.ready_message(vllm_config))
    return proc.run_busy_loop()
