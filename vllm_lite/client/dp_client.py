"""Attaching to a running daemon, and spreading requests over data-parallel engine cores.

A ``vllm-lite serve --data-parallel-size D`` daemon runs D independent engine cores (each with
its own model copy, KV cache and scheduler). Core ``r`` listens at
``vllm_lite.endpoints.dp_core_addresses(base, D)[r]`` (rank 0 at the base address, so a plain
single-core frontend can still attach to it).

``DPCoreClient`` / ``AsyncDPCoreClient`` hold one process client per core and route each new
request by ``dp_router.Router`` (sticky first block, else least loaded). Stats arrive with every
step's outputs and are also polled (``get_stats``) every ``stats_interval_s``, so a core this
frontend has no work on is not judged by stale numbers. Outputs of all cores are merged into one
stream; a request id lives on one core, so aborts go only there. Any core dying makes the whole
client dead. What both share (facts, router bookkeeping, death) is ``_DPClientBase``; the two
shells differ only in threads versus tasks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Optional, Sequence, Union

from vllm_lite.client.async_mp_client import AsyncMPClient
from vllm_lite.client.client_base import (
    AsyncOnlyClient,
    EngineCoreClient,
    OutputItem,
    output_or_raise,
    running_loop,
    shut_down_error,
    take_output,
)
from vllm_lite.client.dp_router import Router, combine_utility_results, merged_facts
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.client.mp_client import MPClientBase
from vllm_lite.client.sync_mp_client import SyncMPClient
from vllm_lite.core.messages import EngineCoreOutputs, EngineCoreRequest
from vllm_lite.endpoints import CoreAddresses, split_addresses

# The router under its old name (tests and tools import it from here).
_Router = Router

__all__ = ["AsyncDPCoreClient", "DPCoreClient", "combine_utility_results", "make_attached_client"]


def make_attached_client(
    address: Union[str, Sequence[str]],
    auth_token: Optional[str] = None,
    *,
    data_parallel_size: int = 1,
    asyncio_mode: bool = False,
    **client_kwargs: Any,
) -> EngineCoreClient:
    """A client attached to a running daemon: one core -> Sync/AsyncMPClient, several -> a DP client.

    Its request ids get a private namespace in the shared core(s) (``request_ids``)."""
    addrs = split_addresses(address, data_parallel_size)
    client_kwargs["namespace_request_ids"] = True
    if len(addrs) == 1:
        cls = AsyncMPClient if asyncio_mode else SyncMPClient
        return cls(addresses=CoreAddresses.from_base(addrs[0]), auth_token=auth_token, **client_kwargs)
    cls_dp = AsyncDPCoreClient if asyncio_mode else DPCoreClient
    return cls_dp(addrs, auth_token, **client_kwargs)


def _attach_all(client_cls: type, addresses: Sequence[str], auth_token: Optional[str], kwargs: dict) -> list:
    """One attached client per core; all or none (a failure shuts down the ones already made)."""
    clients: list = []
    try:
        for addr in addresses:
            clients.append(client_cls(addresses=CoreAddresses.from_base(addr), auth_token=auth_token, **kwargs))
    except BaseException:
        for c in clients:
            c.shutdown()
        raise
    return clients


class _DPClientBase(EngineCoreClient):
    """Facts, routing bookkeeping (under a lock) and death of a client over several cores."""

    # The per-core client a shell attaches with.
    per_core_cls: type[MPClientBase]

    def __init__(
        self,
        addresses: Sequence[str],
        auth_token: Optional[str] = None,
        stats_interval_s: float = 0.5,
        *,
        clients: Optional[Sequence[MPClientBase]] = None,
        **client_kwargs: Any,
    ) -> None:
        # `clients`: already-connected per-core clients (private cores this frontend started) to route over.
        self.clients = (
            list(clients)
            if clients is not None
            else _attach_all(self.per_core_cls, addresses, auth_token, client_kwargs)
        )
        try:
            self.model_facts = merged_facts(self.clients)
        except BaseException:
            for c in self.clients:
                c.shutdown()
            raise
        first = self.clients[0]
        self.client_index = first.client_index
        self.model_path, self.tokenizer_path = first.model_path, first.tokenizer_path
        self.router = Router(len(self.clients), int(self.model_facts["block_size"]))
        self.stats_interval_s = stats_interval_s
        self._lock = threading.Lock()
        self._closed = False

    def _route(self, request: EngineCoreRequest) -> int:
        with self._lock:
            return self.router.route(request)

    def _unroute(self, request_id: str) -> None:
        with self._lock:
            self.router.unroute(request_id)

    def _groups(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        with self._lock:
            return self.router.group_by_core(request_ids)

    def _set_load(self, core: int, stats: dict[str, Any]) -> None:
        with self._lock:
            self.router.set_load(core, stats)

    def _observe(self, core: int, outs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Book one core's finishes and load; tag the outputs with the core's rank."""
        with self._lock:
            self.router.observe(core, outs)
        outs.engine_index = core
        return outs

    def _pump_error(self, e: Exception) -> Optional[EngineDeadError]:
        """What a core's failure means for the merged stream (nothing once we are closing)."""
        if self._closed:
            return None
        return e if isinstance(e, EngineDeadError) else EngineDeadError(str(e))

    def core_for(self, request_id: str) -> Optional[int]:
        """The rank a live request was routed to (None once it finished)."""
        with self._lock:
            return self.router.owner.get(request_id)

    @property
    def is_dead(self) -> bool:
        return any(c.is_dead for c in self.clients)


class DPCoreClient(_DPClientBase):
    """A blocking client over several data-parallel cores (one SyncMPClient each, a pump thread each)."""

    per_core_cls = SyncMPClient

    def __init__(self, addresses: Sequence[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(addresses, *args, **kwargs)
        self._merged: queue.Queue[OutputItem] = queue.Queue()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._pump, args=(i,), name=f"dp-client-pump-{i}", daemon=True)
            for i in range(len(self.clients))
        ] + [threading.Thread(target=self._poll_stats, name="dp-client-stats", daemon=True)]
        for t in self._threads:
            t.start()

    def _poll_stats(self) -> None:
        while not self._stop.wait(self.stats_interval_s):
            for core, client in enumerate(self.clients):
                try:
                    self._set_load(core, client.call_utility("get_stats"))
                except Exception:  # noqa: BLE001 -- a dead core is reported by its pump
                    return

    def _pump(self, core: int) -> None:
        """Move one core's outputs onto the merged queue, booking finishes and load on the way."""
        client = self.clients[core]
        while True:
            try:
                outs = client.get_output()
            except Exception as e:  # noqa: BLE001 -- death of any core ends this client
                err = self._pump_error(e)
                if err is not None:
                    self._merged.put(err)
                return
            self._merged.put(self._observe(core, outs))

    def add_request(self, request: EngineCoreRequest) -> None:
        core = self._route(request)
        try:
            self.clients[core].add_request(request)
        except BaseException:
            self._unroute(request.request_id)
            raise

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Route each request, then one batch per core (each core schedules its share whole)."""
        by_core: dict[int, list[EngineCoreRequest]] = {}
        try:
            for request in requests:
                by_core.setdefault(self._route(request), []).append(request)
            for core, batch in sorted(by_core.items()):
                self.clients[core].add_requests(batch)
        except BaseException:
            for batch in by_core.values():
                for request in batch:
                    self._unroute(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for core, ids in self._groups(request_ids).items():
            self.clients[core].abort_requests(ids)

    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        return take_output(self._merged, timeout)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Runs on every core; results combined by ``combine_utility_results``."""
        return combine_utility_results(method, [c.call_utility(method, *args) for c in self.clients])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for c in self.clients:
            c.shutdown()
        self._merged.put(shut_down_error())


class AsyncDPCoreClient(_DPClientBase, AsyncOnlyClient):
    """The asyncio version, for AsyncLLM and the HTTP frontends (one AsyncMPClient per core, a pump task each)."""

    per_core_cls = AsyncMPClient

    def __init__(self, addresses: Sequence[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(addresses, *args, **kwargs)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._merged: Optional[asyncio.Queue] = None
        self._tasks: list[asyncio.Task] = []

    def _ensure_started(self) -> None:
        if self._closed:
            raise shut_down_error()
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        old = self._merged
        self._loop = loop
        self._merged = asyncio.Queue()
        while old is not None and not old.empty():
            self._merged.put_nowait(old.get_nowait())
        self._tasks = [loop.create_task(self._pump(i), name=f"dp-client-pump-{i}") for i in range(len(self.clients))]
        self._tasks.append(loop.create_task(self._poll_stats(), name="dp-client-stats"))

    async def _poll_stats(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.stats_interval_s)
            for core, client in enumerate(self.clients):
                try:
                    self._set_load(core, await client.call_utility_async("get_stats"))
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 -- a dead core is reported by its pump
                    return

    async def _pump(self, core: int) -> None:
        client = self.clients[core]
        assert self._merged is not None
        merged = self._merged
        while True:
            try:
                outs = await client.get_output_async()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 -- death of any core ends this client
                err = self._pump_error(e)
                if err is not None:
                    merged.put_nowait(err)
                return
            merged.put_nowait(self._observe(core, outs))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_started()
        core = self._route(request)
        try:
            await self.clients[core].add_request_async(request)
        except BaseException:
            self._unroute(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._ensure_started()
        for core, ids in self._groups(request_ids).items():
            await self.clients[core].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self._merged is not None
        return output_or_raise(await self._merged.get(), self._merged.put_nowait)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Runs on every core; results combined by ``combine_utility_results``."""
        self._ensure_started()
        results = await asyncio.gather(*(c.call_utility_async(method, *args) for c in self.clients))
        return combine_utility_results(method, list(results))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            in_loop = running_loop() is loop
            for task in self._tasks:
                task.cancel() if in_loop else loop.call_soon_threadsafe(task.cancel)
        for c in self.clients:
            c.shutdown()
