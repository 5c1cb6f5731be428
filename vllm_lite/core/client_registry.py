"""Who is attached to the engine core, and which live requests belong to whom.

A frontend is known by its ZMQ identity once its HELLO passed the checks (protocol version,
auth token, not shutting down); it then gets a client index, which the core writes onto each of
its requests so outputs go back to it alone. The registry also remembers when each frontend
last spoke (any message counts as a heartbeat) and, for frontends dropped for silence, their
names: such a frontend proved its token once, so if it speaks again it is taken back.
Everything here runs on the busy loop's thread except ``touch``, which the input thread calls.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from typing import Any, Optional

from vllm_lite.core.messages import PROTOCOL_VERSION, HelloRequest
from vllm_lite.log_limiter import LogLimiter

logger = logging.getLogger(__name__)

# How many dropped frontends the core remembers (to take them back if they were only slow).
MAX_REMEMBERED_DROPPED = 1024


class AttachedClient:
    """One attached frontend, as the busy loop sees it."""

    __slots__ = ("identity", "index", "name", "request_ids")

    def __init__(self, identity: bytes, index: int, name: str) -> None:
        self.identity = identity
        self.index = index
        self.name = name
        self.request_ids: set[str] = set()


class ClientRegistry:
    """Identities, indices, names, last-heard times and request ownership of attached frontends."""

    def __init__(
        self,
        auth_token: Optional[str] = None,
        drop_log: Optional[LogLimiter] = None,
        max_remembered_dropped: int = MAX_REMEMBERED_DROPPED,
    ) -> None:
        self.auth_token = auth_token
        self.drop_log = drop_log or LogLimiter(logger)
        self.max_remembered_dropped = max_remembered_dropped
        self._by_identity: dict[bytes, AttachedClient] = {}
        self._by_index: dict[int, AttachedClient] = {}
        self._next_index = 0
        self._owner: dict[str, AttachedClient] = {}  # live request id -> its frontend
        self._dropped: OrderedDict[bytes, str] = OrderedDict()  # dropped for silence: identity -> name
        self._last_seen: dict[bytes, float] = {}  # written by the input thread too

    def __len__(self) -> int:
        return len(self._by_identity)

    def clients(self) -> list[AttachedClient]:
        return list(self._by_identity.values())

    def get(self, identity: bytes) -> Optional[AttachedClient]:
        """The attached frontend with this identity (a dropped one is not taken back here)."""
        return self._by_identity.get(identity)

    def by_index(self, index: int) -> Optional[AttachedClient]:
        return self._by_index.get(index)

    # ------------------------------------------------------------------ attaching
    def refusal(self, hello: HelloRequest, accepting: bool) -> Optional[str]:
        """Why this HELLO is refused, or None to accept it."""
        if hello.protocol_version != PROTOCOL_VERSION:
            return (
                f"protocol version mismatch: frontend speaks {hello.protocol_version}, "
                f"engine core speaks {PROTOCOL_VERSION}"
            )
        if self.auth_token is not None and not hmac.compare_digest(
            (hello.auth_token or "").encode(), self.auth_token.encode()
        ):
            return "wrong auth token"
        if not accepting:
            return "engine core is shutting down"
        return None

    def hello(
        self, identity: bytes, hello: HelloRequest, accepting: bool = True
    ) -> tuple[Optional[AttachedClient], Optional[str]]:
        """Attach (or re-greet) a frontend: ``(client, None)``, or ``(None, reason)`` when refused."""
        reason = self.refusal(hello, accepting)
        if reason is not None:
            # Rate-limited: a peer spraying wrong tokens must not flood the log.
            self.drop_log.warn("Refused frontend %r (%s): %s.", hello.client_name[:100], identity.hex(), reason)
            return None, reason
        client = self._by_identity.get(identity)
        if client is None:
            self._dropped.pop(identity, None)
            client = self._register(identity, hello.client_name)
            logger.info("Frontend %r attached as client %d.", hello.client_name, client.index)
        self._last_seen[identity] = time.monotonic()
        return client, None

    def lookup(self, identity: bytes, what: str) -> Optional[AttachedClient]:
        """The sender of a message, taking back a frontend dropped for silence; None (logged) if unknown."""
        client = self._by_identity.get(identity)
        if client is None and identity in self._dropped:
            # Alive after all (e.g. its event loop started late): it proved its token at HELLO,
            # so take it back. Its old requests already ended with ABORT outputs.
            client = self._register(identity, self._dropped.pop(identity))
            logger.info("Frontend %r came back; re-attached as client %d.", client.name, client.index)
        if client is None:
            self.drop_log.warn("Dropped %s from frontend %s that has not said HELLO.", what, identity.hex())
        return client

    def _register(self, identity: bytes, name: str) -> AttachedClient:
        client = AttachedClient(identity, self._next_index, name)
        self._next_index += 1
        self._by_identity[identity] = client
        self._by_index[client.index] = client
        self._last_seen[identity] = time.monotonic()
        return client

    # ------------------------------------------------------------------ liveness
    def touch(self, identity: bytes) -> bool:
        """Input thread: note that an attached frontend spoke; False for unknown identities."""
        if identity not in self._by_identity:
            return False
        self._last_seen[identity] = time.monotonic()
        return True

    def silent(self, timeout_s: float, now: Optional[float] = None) -> list[tuple[AttachedClient, float]]:
        """Frontends silent for longer than ``timeout_s``, with how long they have been."""
        now = time.monotonic() if now is None else now
        found = []
        for client in self.clients():
            silent_s = now - self._last_seen.get(client.identity, now)
            if silent_s > timeout_s:
                found.append((client, silent_s))
        return found

    def drop(self, client: AttachedClient, may_return: bool = True) -> list[str]:
        """Detach a frontend; returns its live request ids (sorted), which no longer belong to anyone.

        ``may_return``: remember it (dropped for silence) so that it is taken back if it speaks again.
        """
        ids = sorted(client.request_ids)
        for rid in ids:
            self._owner.pop(rid, None)
        client.request_ids.clear()
        self._by_identity.pop(client.identity, None)
        self._by_index.pop(client.index, None)
        self._last_seen.pop(client.identity, None)
        if may_return:
            self._dropped[client.identity] = client.name
            while len(self._dropped) > self.max_remembered_dropped:
                self._dropped.popitem(last=False)
        return ids

    def was_dropped(self, identity: bytes) -> bool:
        return identity in self._dropped

    # ------------------------------------------------------------------ request ownership
    def owner(self, request_id: str) -> Optional[AttachedClient]:
        return self._owner.get(request_id)

    def own(self, client: AttachedClient, request_id: str) -> None:
        self._owner[request_id] = client
        client.request_ids.add(request_id)

    def release(self, request_id: str) -> None:
        """The request is over (finished or aborted)."""
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            owner.request_ids.discard(request_id)

    def mine(self, client: AttachedClient, request_ids: list[str]) -> list[str]:
        """The ids among ``request_ids`` that ``client`` owns (a frontend may only abort its own)."""
        return [rid for rid in request_ids if self._owner.get(rid) is client]

    def release_all(self) -> list[tuple[AttachedClient, list[str]]]:
        """Every frontend with live requests and their ids (sorted); none is owned afterwards."""
        taken = []
        for client in self.clients():
            if client.request_ids:
                taken.append((client, sorted(client.request_ids)))
                client.request_ids.clear()
        self._owner.clear()
        return taken

    def list_frontends(self) -> list[dict[str, Any]]:
        """The ``list_frontends`` utility's answer."""
        return [{"client_index": c.index, "name": c.name, "num_requests": len(c.request_ids)} for c in self.clients()]
