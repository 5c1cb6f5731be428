"""The engine core's two ROUTER sockets and the threads that own them.

Sockets (the core always binds, frontends connect):

* ``input``  ROUTER. A frontend connects a DEALER with a fixed identity and sends
  ``[type, *payload]`` where ``type`` is one ``EngineCoreRequestType`` byte:
  HELLO(HelloRequest), ADD(EngineCoreRequest), ADD_BATCH(EngineCoreRequestBatch), ABORT(list[str]),
  UTILITY(UtilityRequest), HEARTBEAT(no payload), GOODBYE(no payload: detach now), STOP_VERDICT(StopVerdict).
* ``output`` ROUTER. The same frontend connects a second DEALER with the *same*
  identity; the core sends it ``[type, *payload]`` where ``type`` is one
  ``EngineCoreOutputType`` byte: READY/REFUSED(HandshakeReply),
  OUTPUTS(EngineCoreOutputs), HEARTBEAT(no payload).

Two sockets because a ZMQ socket belongs to one thread: the input thread owns ``input`` and
the output thread owns ``output``, so decoding and encoding overlap with the model step.

* input thread: recv -> typed decode -> input queue. Only a HELLO (at most ``MAX_HELLO_BYTES``)
  is decoded for an identity that has not completed one (or been dropped and may return):
  anything else from a stranger is counted and dropped undecoded, so a peer without the token
  cannot make the core parse anything big. A malformed or wrong-typed message is dropped with a
  (rate-limited) log line; it never reaches the loop. HEARTBEATs from attached frontends are
  answered right here (straight onto the output queue), so a long model step does not look
  like a dead core.
* limits: ``ZMQ_MAXMSGSIZE`` on the input socket (``max_input_message_bytes``: the largest legitimate
  ADD for this model, with room to spare) and a tiny one on the output socket (frontends never
  send there): a bigger message makes libzmq drop that connection, before any of it is queued.
* disconnects: a monitor on the input socket reports each closed connection by its fd; the fd
  of each identity's connection is learned from its messages (``ZMQ_SRCFD``), so a frontend
  whose process died is reported to the loop as ``SocketEvent.DISCONNECTED`` within
  milliseconds instead of after a heartbeat timeout. (``ZMQ_ROUTER_NOTIFY`` would name the
  identity directly, but it is a draft option that pyzmq's bundled libzmq lacks.)
* output thread: output queue -> encode -> send. A handshake reply to a frontend whose output
  DEALER is still connecting is retried for a few seconds; other messages to an unreachable
  frontend are dropped (logged once). A utility result msgpack cannot carry fails that call.

Sockets are bound before the model loads, so a busy address fails at once.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Union

import zmq
from zmq.utils.monitor import parse_monitor_message

from vllm_lite.core.messages import (
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestBatch,
    EngineCoreRequestType,
    HelloRequest,
    StopVerdict,
    UtilityOutput,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.log_limiter import LogLimiter
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

# How long the output thread retries a READY for a frontend whose output DEALER is still connecting.
READY_RETRY_S = 5.0
_BIND_TIMEOUT_S = 10.0

# A HELLO carries a version, a token and a name: anything bigger is not one.
MAX_HELLO_BYTES = 16 * 1024
# Frontends never send on the output socket; its ROUTER only needs room for nothing.
MAX_OUTPUT_SOCKET_MESSAGE_BYTES = 256
# Room for strings a request may carry (stop strings, bad words, a structured-output schema).
_MESSAGE_SLACK_BYTES = 16 << 20
# msgpack bytes per token id or vocab entry, worst case: ids (<= 9 bytes each) in the prompt,
# allowed_token_ids and bad words, plus a logit_bias entry (an id and a float64).
_BYTES_PER_TOKEN = 32


def max_input_message_bytes(max_model_len: int, vocab_size: int) -> int:
    """The ZMQ_MAXMSGSIZE of the input socket: a prompt of ``max_model_len`` ids plus sampling
    params that name every vocab entry, with 16 MiB for strings; 16 MiB + 32 B/token in all."""
    return _MESSAGE_SLACK_BYTES + _BYTES_PER_TOKEN * (max(0, max_model_len) + max(0, vocab_size))


class SocketEvent(enum.Enum):
    """Input-queue items that the socket itself produced (never on the wire)."""

    DISCONNECTED = "disconnected"  # the frontend's input connection closed: it is gone


# Items on the input queue: (identity, request type or socket event, decoded payload).
InputItem = tuple[bytes, Union[EngineCoreRequestType, SocketEvent], Any]
# Items on the output queue: (identity, output type, struct or None), or None to stop.
OutputItem = Optional[tuple[bytes, EngineCoreOutputType, Any]]

_NOTHING = object()
_NO_PAYLOAD = (EngineCoreRequestType.HEARTBEAT, EngineCoreRequestType.GOODBYE)


class CoreSockets:
    """Binds both sockets, runs their threads, and moves typed messages through two queues.

    ``is_attached(identity)`` is called on the input thread for every message: True means the
    sender completed HELLO (its heartbeats are then answered at once, not queued).
    ``may_return(identity)``: a frontend the loop dropped but would take back; its messages
    are decoded too. Every other identity gets its HELLO decoded and nothing else.
    ``max_message_bytes``: ZMQ_MAXMSGSIZE of the input socket (None: no limit).

    Counters (read by tests and stats; written by the input thread only): ``decoded_messages``,
    ``undecoded_refusals`` (messages from strangers dropped without decoding), ``disconnects``
    (frontends reported gone by the socket monitor).
    """

    def __init__(
        self,
        addresses: CoreAddresses,
        is_attached: Callable[[bytes], bool],
        drop_log: LogLimiter,
        input_fd: Optional[int] = None,
        output_fd: Optional[int] = None,
        may_return: Callable[[bytes], bool] = lambda identity: False,
        max_message_bytes: Optional[int] = None,
    ) -> None:
        self.addresses = addresses
        self._is_attached = is_attached
        self._may_return = may_return
        self._drop_log = drop_log
        self.max_message_bytes = max_message_bytes
        self.decoded_messages = 0
        self.undecoded_refusals = 0
        self.disconnects = 0
        self.input_queue: queue.Queue[InputItem] = queue.Queue()
        self.output_queue: queue.Queue[OutputItem] = queue.Queue()
        self._stop_input = threading.Event()
        self._zmq = zmq.Context()
        ready = [threading.Event(), threading.Event()]
        errors: list[BaseException] = []
        self._threads = [
            threading.Thread(
                target=self._input_main, args=(input_fd, ready[0], errors), name="core-input", daemon=True
            ),
            threading.Thread(
                target=self._output_main, args=(output_fd, ready[1], errors), name="core-output", daemon=True
            ),
        ]
        for t in self._threads:
            t.start()
        for ev in ready:
            ev.wait(_BIND_TIMEOUT_S)
        if errors or not all(ev.is_set() for ev in ready):
            self.stop()
            raise RuntimeError(
                f"Engine core could not bind its sockets {addresses}: {errors[0] if errors else 'timeout'}"
            )

    def send(self, identity: bytes, kind: EngineCoreOutputType, obj: Any = None) -> None:
        """Queue one message for a frontend (any thread)."""
        self.output_queue.put((identity, kind, obj))

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        """Flush everything queued so far, then stop both threads and close the sockets."""
        self.output_queue.put(None)
        self._threads[1].join(timeout=5.0)
        self._stop_input.set()
        self._threads[0].join(timeout=2.0)
        self._zmq.term()

    # ------------------------------------------------------------------ threads
    def _bind(
        self,
        address: str,
        linger: int,
        fd: Optional[int],
        mandatory: bool = False,
        sndhwm: Optional[int] = None,
        max_msg_size: Optional[int] = None,
    ) -> zmq.Socket:
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
            if max_msg_size is not None:
                sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
            sock.bind(address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _bind_or_report(self, ready: threading.Event, errors: list[BaseException], **kw: Any) -> Optional[zmq.Socket]:
        try:
            return self._bind(**kw)
        except BaseException as e:  # noqa: BLE001 -- reported to the constructor
            errors.append(e)
            return None
        finally:
            ready.set()

    def _input_main(self, fd: Optional[int], ready: threading.Event, errors: list[BaseException]) -> None:
        sock = self._bind_or_report(
            ready, errors, address=self.addresses.input, linger=0, fd=fd, max_msg_size=self.max_message_bytes
        )
        if sock is None:
            return
        monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ADD_BATCH: MsgpackDecoder(EngineCoreRequestBatch),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
            EngineCoreRequestType.HELLO: MsgpackDecoder(HelloRequest),
            EngineCoreRequestType.STOP_VERDICT: MsgpackDecoder(StopVerdict),
        }
        conns = _Connections()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop_input.is_set():
                if not poller.poll(100):
                    continue
                self._drain_monitor(monitor, conns)
                for _ in range(64):  # a batch, then the stop flag again
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    frames = sock.recv_multipart(copy=False)
                    # A connection that closed before this message was read is reported first,
                    # so a new connection that reuses its fd is never mistaken for the old one.
                    self._drain_monitor(monitor, conns)
                    self._on_message(frames, decoders, conns)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _drain_monitor(self, monitor: zmq.Socket, conns: "_Connections") -> None:
        while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(monitor.recv_multipart())
            conn_fd = int(event["value"])
            if event["event"] == zmq.EVENT_DISCONNECTED:
                identity = conns.closed(conn_fd)
                if identity is not None:
                    self.disconnects += 1
                    self.input_queue.put((identity, SocketEvent.DISCONNECTED, None))
            else:  # ACCEPTED: a new connection on this fd, nobody's yet
                conns.closed(conn_fd)

    def _on_message(
        self, frames: list[Any], decoders: dict[EngineCoreRequestType, MsgpackDecoder], conns: "_Connections"
    ) -> None:
        identity = frames[0].bytes
        try:
            kind = _kind(frames)
        except ValueError as e:
            self._drop_log.warn("Dropped malformed message from %s: %s", identity.hex(), e)
            return
        attached = self._is_attached(identity)
        if kind is EngineCoreRequestType.HELLO:
            size = sum(len(f) for f in frames[2:])
            if size > MAX_HELLO_BYTES:
                self.undecoded_refusals += 1
                self._drop_log.warn(
                    "Dropped a %d-byte HELLO from %s (at most %d).", size, identity.hex(), MAX_HELLO_BYTES
                )
                return
        elif not attached and not self._may_return(identity):
            # Not decoded: a stranger's ADD could be anything up to the size limit.
            self.undecoded_refusals += 1
            self._drop_log.warn("Dropped %s from %s, which has not completed HELLO.", kind.name, identity.hex())
            return
        try:
            payload = _payload(kind, frames, decoders)
        except Exception as e:  # noqa: BLE001 -- whatever a peer sends, it never kills the core
            self._drop_log.warn("Dropped malformed message from %s: %s", identity.hex(), e)
            return
        self.decoded_messages += 1
        conns.seen(frames[0], identity)
        if attached and kind is EngineCoreRequestType.HEARTBEAT:
            self.send(identity, EngineCoreOutputType.HEARTBEAT)
            return
        # Everything else goes to the loop, which also decides about unknown frontends.
        self.input_queue.put((identity, kind, payload))

    def _output_main(self, fd: Optional[int], ready: threading.Event, errors: list[BaseException]) -> None:
        # No send limit: with ROUTER_MANDATORY a full pipe would block every frontend's outputs
        # behind one slow reader (a reader that stops altogether is dropped by the heartbeat watch).
        sock = self._bind_or_report(
            ready,
            errors,
            address=self.addresses.output,
            linger=2000,
            fd=fd,
            mandatory=True,
            sndhwm=0,
            max_msg_size=MAX_OUTPUT_SOCKET_MESSAGE_BYTES,
        )
        if sock is None:
            return
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
                    pending = [p for p in pending if not _try_send(sock, p[0], p[1], unreachable)]
                if item is _NOTHING:
                    continue
                if item is None:
                    break
                identity, kind, obj = item  # type: ignore[misc]
                frames = _encode(encoder, identity, kind, obj)
                if frames is None:
                    continue
                is_handshake = kind in (EngineCoreOutputType.READY, EngineCoreOutputType.REFUSED)
                give_up = time.monotonic() + (READY_RETRY_S if is_handshake else 0.0)
                if not _try_send(sock, frames, give_up, unreachable):
                    pending.append((frames, give_up))
        finally:
            sock.close()


class _Connections:
    """Which identity each input connection (by fd) belongs to, learned from its messages.

    Input thread only. One connection per identity: a frontend that reconnects (ROUTER_HANDOVER)
    moves to its new fd, so the old connection's close does not report it gone."""

    def __init__(self) -> None:
        self._by_fd: dict[int, bytes] = {}
        self._fd_of: dict[bytes, int] = {}

    def seen(self, frame: Any, identity: bytes) -> None:
        try:
            fd = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError):
            return
        if fd < 0 or self._by_fd.get(fd) == identity:
            return
        old = self._fd_of.pop(identity, None)
        if old is not None:
            self._by_fd.pop(old, None)
        prev = self._by_fd.pop(fd, None)
        if prev is not None:
            self._fd_of.pop(prev, None)
        self._by_fd[fd] = identity
        self._fd_of[identity] = fd

    def closed(self, fd: int) -> Optional[bytes]:
        """The identity whose connection this fd was (now forgotten), or None."""
        identity = self._by_fd.pop(fd, None)
        if identity is not None:
            self._fd_of.pop(identity, None)
        return identity


def _kind(frames: list[Any]) -> EngineCoreRequestType:
    """Frame 1's message type (frame 0 is the identity), without looking at the payload."""
    if len(frames) < 2:
        raise ValueError("message has no type frame")
    return EngineCoreRequestType(frames[1].bytes)


def _payload(
    kind: EngineCoreRequestType, frames: list[Any], decoders: dict[EngineCoreRequestType, MsgpackDecoder]
) -> Any:
    if kind in _NO_PAYLOAD:
        return None
    if len(frames) < 3:
        raise ValueError(f"{kind.name} message has no payload")
    return decoders[kind].decode(frames[2:])


def _encode(encoder: MsgpackEncoder, identity: bytes, kind: EngineCoreOutputType, obj: Any) -> Optional[list[Any]]:
    """The frames of one message; a utility result msgpack cannot carry fails that call, not the core."""
    try:
        return [identity, kind.value, *encoder.encode(obj)] if obj is not None else [identity, kind.value]
    except (TypeError, ValueError, OverflowError) as e:
        util = getattr(obj, "utility_output", None)
        if util is not None:
            failed = UtilityOutput(
                util.call_id, failure_message=f"result cannot be sent: {e}", failure_type="TypeError"
            )
            return [identity, kind.value, *encoder.encode(EngineCoreOutputs(utility_output=failed))]
        logger.error("Could not encode outputs for %s: %s", identity.hex(), e)
        return None


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
