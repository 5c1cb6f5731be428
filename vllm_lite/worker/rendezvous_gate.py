"""Token-authenticated access to the tensor-parallel rendezvous store from other nodes.

torch.distributed's TCPStore has no authentication (anyone who reaches its port can read the
engine's config, list and write keys, and join the process group's rendezvous) and its server
binds every interface. So the store always listens on loopback, and other nodes reach it only
through a gate: on node 0, ``RendezvousGate`` listens on ``master_addr:master_port``, proves each
connection knows the engine's auth token (challenge-response, so a recorded answer is useless),
then relays bytes to the loopback store. On a worker node, ``RendezvousTunnel`` listens on
loopback for that node's ranks and carries each of their store connections through the gate.

The relay only carries the store's rendezvous traffic (keys, barriers, liveness checks); the
step traffic goes over the executor's ZMQ socket, where ranks have unpredictable identities
published only in the store.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from typing import Optional

from vllm_lite.log_limiter import LogLimiter

logger = logging.getLogger("vllm_lite.rendezvous")

NONCE_LEN = 32
_PROOF_CONTEXT = b"vllm-lite tensor-parallel rendezvous v1"
PROOF_LEN = hashlib.sha256().digest_size
# How long a peer has to answer the challenge before it is dropped.
HANDSHAKE_TIMEOUT_S = 10.0
_ACCEPTED = b"\x01"


def handshake_proof(token: str, nonce: bytes) -> bytes:
    """What a peer that knows ``token`` answers to ``nonce``."""
    return hmac.new(token.encode(), _PROOF_CONTEXT + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection during the rendezvous handshake")
        buf += chunk
    return buf


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes; then close both."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    t = threading.Thread(target=pump, args=(b, a), daemon=True, name="rendezvous-relay")
    t.start()
    pump(a, b)
    t.join()
    a.close()
    b.close()


class _RelayListener:
    """A listening socket whose accepted connections each get a thread running ``_handle``."""

    _thread_name = "rendezvous-gate"
    _peer_thread_name = "rendezvous-peer"

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=self._thread_name)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn, peer), daemon=True, name=self._peer_thread_name).start()

    def _handle(self, conn: socket.socket, peer: tuple) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass


class RendezvousGate(_RelayListener):
    """Node 0: accept on ``listener``; relay connections that prove the token to the loopback store."""

    def __init__(self, listener: socket.socket, store_port: int, token: str) -> None:
        if not token:
            raise ValueError("the rendezvous gate needs a non-empty auth token.")
        self.store_port = store_port
        self._token = token
        self._refusals = LogLimiter(logger)  # a flood of bad peers must not flood the log
        super().__init__(listener)

    def _handle(self, conn: socket.socket, peer: tuple) -> None:
        nonce = os.urandom(NONCE_LEN)
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.sendall(nonce)
            proof = _recv_exact(conn, PROOF_LEN)
            if not hmac.compare_digest(proof, handshake_proof(self._token, nonce)):
                self._refusals.warn("Refused a rendezvous connection from %s: wrong auth token.", peer[0])
                conn.close()
                return
            conn.sendall(_ACCEPTED)
            conn.settimeout(None)
            store = socket.create_connection(("127.0.0.1", self.store_port))
        except OSError as e:
            self._refusals.warn("Dropped a rendezvous connection from %s: %s", peer[0], e)
            conn.close()
            return
        _relay(conn, store)


class RendezvousTunnel(_RelayListener):
    """A worker node: a loopback port whose connections reach node 0's store through its gate."""

    _thread_name = "rendezvous-tunnel"
    _peer_thread_name = "rendezvous-carry"

    def __init__(self, master_addr: str, master_port: int, token: Optional[str], connect_timeout_s: float) -> None:
        if not token:
            raise ValueError(
                "multi-node tensor parallelism needs the engine's auth token (--auth-token or VLLM_LITE_AUTH_TOKEN): "
                "node 0's rendezvous admits only peers that prove it."
            )
        self.master = (master_addr, master_port)
        self._token = token
        self.connect_timeout_s = connect_timeout_s
        super().__init__(socket.create_server(("127.0.0.1", 0)))

    def open_upstream(self) -> socket.socket:
        """A connection to node 0's gate that passed the handshake (retried until node 0 is up)."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                up = socket.create_connection(self.master, timeout=HANDSHAKE_TIMEOUT_S)
                nonce = _recv_exact(up, NONCE_LEN)
            except OSError:  # node 0 not up (yet): refused, unreachable, or closed before its challenge
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
                continue
            try:
                up.sendall(handshake_proof(self._token, nonce))
                answer = _recv_exact(up, 1)
            except OSError:
                answer = b""
            if answer != _ACCEPTED:  # node 0 heard our proof and hung up
                up.close()
                raise PermissionError(
                    f"node 0's rendezvous at {self.master[0]}:{self.master[1]} refused this node: wrong auth token?"
                )
            up.settimeout(None)
            return up

    def _handle(self, local: socket.socket, peer: tuple) -> None:
        """Carry one local rank's store connection through node 0's gate."""
        try:
            up = self.open_upstream()
        except OSError as e:
            logger.error("cannot reach node 0's rendezvous at %s:%d: %s", *self.master, e)
            local.close()
            return
        _relay(local, up)
