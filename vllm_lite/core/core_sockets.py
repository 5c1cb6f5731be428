"""The engine core's two ROUTER sockets and the threads that own them.

Sockets (the core always binds, frontends connect):

* ``input``  ROUTER. A frontend connects a DEALER with a fixed identity and sends
  ``[type, *payload]`` where ``type`` is one ``EngineCoreRequestType`` byte:
  HELLO(HelloRequest), ADD(EngineCoreRequest), ABORT(list[str]),
  UTILITY(UtilityRequest), HEARTBEAT(no payload), GOODBYE(no payload: detach now).
* ``output`` ROUTER. The same frontend connects a second DEALER with the *same*
  identity; the core sends it ``[type, *payload]`` where ``type`` is one
  ``EngineCoreOutputType`` byte: READY/REFUSED(HandshakeReply),
  OUTPUTS(EngineCoreOutputs), HEARTBEAT(no payload).

Two sockets because a ZMQ socket belongs to one thread: the input thread owns ``input`` and
the output thread owns ``output``, so decoding and encoding overlap with the model step.

* input thread: recv -> typed decode -> input queue. A malformed or wrong-typed message is
  dropped with a log line; it never reaches the loop. HEARTBEATs from attached frontends are
  answered right here (straight onto the output queue), so a long model step does not look
  like a dead core.
* output thread: output queue -> encode -> send. A handshake reply to a frontend whose output
  DEALER is still connecting is retried for a few seconds; other messages to an unreachable
  frontend are dropped (logged once). A utility result msgpack cannot carry fails that call.

Sockets are bound before the model loads, so a busy address fails at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import zmq

from vllm_lite.core.log_limiter import LogLimiter
from vllm_lite.core.messages import (
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreRequest,
    EngineCoreRequestType,
    HelloRequest,
    UtilityOutput,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

# How long the output thread retries a READY for a frontend whose output DEALER is still connecting.
READY_RETRY_S = 5.0
_BIND_TIMEOUT_S = 10.0

# Items on the input queue: (identity, request type, decoded payload).
InputItem = tuple[bytes, EngineCoreRequestType, Any]
# Items on the output queue: (identity, output type, struct or None), or None to stop.
OutputItem = Optional[tuple[bytes, EngineCoreOutputType, Any]]

_NOTHING = object()
_NO_PAYLOAD = (EngineCoreRequestType.HEARTBEAT, EngineCoreRequestType.GOODBYE)


class CoreSockets:
    """Binds both sockets, runs their threads, and moves typed messages through two queues.

    ``is_attached(identity)`` is called on the input thread for every message: True means the
    sender completed HELLO (its heartbeats are then answered at once, not queued).
    """

    def __init__(
        self,
        addresses: CoreAddresses,
        is_attached: Callable[[bytes], bool],
        drop_log: LogLimiter,
        input_fd: Optional[int] = None,
        output_fd: Optional[int] = None,
    ) -> None:
        self.addresses = addresses
        self._is_attached = is_attached
        self._drop_log = drop_log
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
        self, address: str, linger: int, fd: Optional[int], mandatory: bool = False, sndhwm: Optional[int] = None
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
        sock = self._bind_or_report(ready, errors, address=self.addresses.input, linger=0, fd=fd)
        if sock is None:
            return
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
            EngineCoreRequestType.HELLO: MsgpackDecoder(HelloRequest),
        }
        try:
            while not self._stop_input.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                identity = frames[0].bytes
                try:
                    kind, payload = self._decode(frames, decoders)
                except Exception as e:  # noqa: BLE001 -- whatever a peer sends, it never kills the core
                    self._drop_log.warn("Dropped malformed message from %s: %s", identity.hex(), e)
                    continue
                if self._is_attached(identity) and kind is EngineCoreRequestType.HEARTBEAT:
                    self.send(identity, EngineCoreOutputType.HEARTBEAT)
                    continue
                # Everything else goes to the loop, which also decides about unknown frontends.
                self.input_queue.put((identity, kind, payload))
        finally:
            sock.close(linger=0)

    @staticmethod
    def _decode(
        frames: list[Any], decoders: dict[EngineCoreRequestType, MsgpackDecoder]
    ) -> tuple[EngineCoreRequestType, Any]:
        if len(frames) < 2:
            raise ValueError("message has no type frame")
        kind = EngineCoreRequestType(frames[1].bytes)
        if kind in _NO_PAYLOAD:
            return kind, None
        if len(frames) < 3:
            raise ValueError(f"{kind.name} message has no payload")
        return kind, decoders[kind].decode(frames[2:])

    def _output_main(self, fd: Optional[int], ready: threading.Event, errors: list[BaseException]) -> None:
        # No send limit: with ROUTER_MANDATORY a full pipe would block every frontend's outputs
        # behind one slow reader (a reader that stops altogether is dropped by the heartbeat watch).
        sock = self._bind_or_report(
            ready, errors, address=self.addresses.output, linger=2000, fd=fd, mandatory=True, sndhwm=0
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
