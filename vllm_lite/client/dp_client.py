"""Attaching to a running daemon, and spreading requests over data-parallel engine cores.

A ``vllm-lite serve --data-parallel-size D`` daemon runs D independent engine
cores (each with its own model copy, KV cache and scheduler). Core ``r`` listens
at ``vllm_lite.endpoints.dp_core_addresses(base, D)[r]`` (rank 0 at the base address,
so a plain single-core frontend can still attach to it).

``DPCoreClient`` / ``AsyncDPCoreClient`` hold one attached client per core and
route each new request:

* sticky: a request whose first prompt block (``block_size`` tokens) was seen
  before goes to the core that served it, so shared prefixes (a chat's
  follow-ups, a common system prompt) hit that core's prefix cache;
* otherwise least-loaded: the core with the fewest requests this frontend has
  in flight there plus the running + waiting requests its latest scheduler
  stats report (which include other frontends' work). Stats arrive with every
  step's outputs and are also polled (``get_stats``) every ``stats_interval_s``,
  so a core this frontend has no work on is not judged by stale numbers.
  A sticky core much busier than the least-loaded one (``sticky_slack``) loses
  the prefix to it.

Outputs of all cores are merged into one stream; a request id lives on one
core, so aborts go only there. Any core dying makes the whole client dead.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import uuid
from collections import OrderedDict
from typing import Any, Optional, Sequence, Union

import msgspec

from vllm_lite.client.core_client import AsyncMPClient, EngineCoreClient, SyncMPClient
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from vllm_lite.endpoints import CoreAddresses, split_addresses

# How many first-block hashes a router remembers (LRU) for sticky routing.
_MAX_STICKY_PREFIXES = 65536


def make_attached_client(
    address: Union[str, Sequence[str]],
    auth_token: Optional[str] = None,
    *,
    data_parallel_size: int = 1,
    asyncio_mode: bool = False,
    **client_kwargs: Any,
) -> EngineCoreClient:
    """A client attached to a running daemon: one core -> Sync/AsyncMPClient, several -> a DP client."""
    addrs = split_addresses(address, data_parallel_size)
    inner: EngineCoreClient
    if len(addrs) == 1:
        cls = AsyncMPClient if asyncio_mode else SyncMPClient
        inner = cls(addresses=CoreAddresses.from_base(addrs[0]), auth_token=auth_token, **client_kwargs)
    else:
        cls_dp = AsyncDPCoreClient if asyncio_mode else DPCoreClient
        inner = cls_dp(addrs, auth_token, **client_kwargs)
    return NamespacedClient(inner)


class NamespacedClient(EngineCoreClient):
    """Gives this frontend's request ids a private namespace in a shared core.

    The core keys requests by id across all attached frontends, so two frontends
    both sending "req-0" would clash. This wrapper prefixes every id it sends
    with a random tag of its own and strips it from every output, so callers
    keep choosing ids freely. Everything else is passed through.
    """

    def __init__(self, inner: EngineCoreClient) -> None:
        self.inner = inner
        self.prefix = f"{uuid.uuid4().hex[:12]}/"
        self._n = len(self.prefix)

    def __getattr__(self, name: str) -> Any:  # model_facts, client_index, model_path, is_dead, clients, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _wrap(self, request: EngineCoreRequest) -> EngineCoreRequest:
        return msgspec.structs.replace(request, request_id=self.prefix + request.request_id)

    def _unwrap(self, outs: EngineCoreOutputs) -> EngineCoreOutputs:
        n, prefix = self._n, self.prefix
        for out in outs.outputs:
            if out.request_id.startswith(prefix):
                out.request_id = out.request_id[n:]
        return outs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.inner.add_request(self._wrap(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.inner.abort_requests([self.prefix + rid for rid in request_ids])

    def get_output(self, *args: Any, **kwargs: Any) -> EngineCoreOutputs:
        return self._unwrap(self.inner.get_output(*args, **kwargs))

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.inner.call_utility(method, *args)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.inner.add_request_async(self._wrap(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        await self.inner.abort_requests_async([self.prefix + rid for rid in request_ids])

    async def get_output_async(self) -> EngineCoreOutputs:
        return self._unwrap(await self.inner.get_output_async())

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await self.inner.call_utility_async(method, *args)

    def core_for(self, request_id: str) -> Optional[int]:
        """Data parallel: the rank a live request was routed to (0 for a single core)."""
        core_for = getattr(self.inner, "core_for", None)
        return core_for(self.prefix + request_id) if core_for is not None else 0

    def shutdown(self) -> None:
        self.inner.shutdown()


class _Router:
    """Which core a new request goes to (see the module docstring). Not thread-safe: callers lock."""

    def __init__(self, num_cores: int, block_size: int, sticky_slack: int = 32) -> None:
        self.num_cores = num_cores
        self.block_size = max(1, block_size)
        # A cached prefix is worth waiting behind this many more requests than the least-loaded core has.
        self.sticky_slack = sticky_slack
        self.in_flight = [0] * num_cores  # this frontend's requests per core
        self.core_load = [0] * num_cores  # running + waiting, from each core's latest stats
        self.owner: dict[str, int] = {}  # live request id -> core
        self.sticky: OrderedDict[bytes, int] = OrderedDict()
        self.routed = [0] * num_cores  # total requests sent to each core (for stats and tests)

    def _prefix_key(self, token_ids: Sequence[int]) -> Optional[bytes]:
        if len(token_ids) < self.block_size:
            return None  # no full block: nothing a prefix cache could share
        head = ",".join(map(str, token_ids[: self.block_size])).encode()
        return hashlib.blake2b(head, digest_size=16).digest()

    def load(self, core: int) -> int:
        return self.in_flight[core] + self.core_load[core]

    def route(self, request: EngineCoreRequest) -> int:
        key = self._prefix_key(request.prompt_token_ids)
        least = min(range(self.num_cores), key=lambda i: (self.load(i), self.routed[i]))
        core = self.sticky.get(key) if key is not None else None
        if core is None or self.load(core) > self.load(least) + self.sticky_slack:
            core = least  # new prefix, or its core is far busier than the rest: re-home it
        if key is not None:
            self.sticky[key] = core
            self.sticky.move_to_end(key)
            while len(self.sticky) > _MAX_STICKY_PREFIXES:
                self.sticky.popitem(last=False)
        self.owner[request.request_id] = core
        self.in_flight[core] += 1
        self.routed[core] += 1
        return core

    def unroute(self, request_id: str) -> None:
        """The request is over (finished, aborted or never sent)."""
        core = self.owner.pop(request_id, None)
        if core is not None:
            self.in_flight[core] -= 1

    def group_by_core(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            core = self.owner.get(rid)
            if core is not None:
                groups.setdefault(core, []).append(rid)
        return groups

    def set_load(self, core: int, stats: dict[str, Any]) -> None:
        """A core's load from a polled ``get_stats`` (other frontends' requests included)."""
        self.core_load[core] = int(stats.get("num_running_reqs", 0)) + int(stats.get("num_waiting_reqs", 0))

    def observe(self, core: int, outs: EngineCoreOutputs) -> None:
        """Book finished requests and the core's latest load."""
        stats: Optional[SchedulerStats] = outs.scheduler_stats
        if stats is not None:
            self.core_load[core] = stats.num_running_reqs + stats.num_waiting_reqs
        for out in outs.outputs:
            if out.finish_reason is not None:
                self.unroute(out.request_id)


def _merged_facts(clients: Sequence[Any]) -> dict[str, Any]:
    facts = dict(clients[0].model_facts)
    for c in clients[1:]:
        for key in ("model", "max_model_len", "block_size", "vocab_size"):
            if c.model_facts.get(key) != facts.get(key):
                raise ValueError(
                    f"data-parallel cores disagree on {key}: {facts.get(key)!r} vs {c.model_facts.get(key)!r}."
                )
    facts["num_gpu_blocks"] = min(int(c.model_facts["num_gpu_blocks"]) for c in clients)
    facts["data_parallel_size"] = len(clients)
    return facts


def _attach_all(client_cls: Any, addresses: Sequence[str], auth_token: Optional[str], kwargs: dict) -> list:
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


def _init_from_clients(dp: Any, stats_interval_s: float) -> None:
    """Facts, identity and router of a DP client, from its attached per-core clients."""
    try:
        dp.model_facts = _merged_facts(dp.clients)
    except BaseException:
        for c in dp.clients:
            c.shutdown()
        raise
    first = dp.clients[0]
    dp.client_index = first.client_index
    dp.model_path, dp.tokenizer_path = first.model_path, first.tokenizer_path
    dp.router = _Router(len(dp.clients), int(dp.model_facts["block_size"]))
    dp.stats_interval_s = stats_interval_s


class DPCoreClient(EngineCoreClient):
    """A blocking client over several attached data-parallel cores (one SyncMPClient each)."""

    def __init__(
        self,
        addresses: Sequence[str],
        auth_token: Optional[str] = None,
        stats_interval_s: float = 0.5,
        *,
        clients: Optional[Sequence[SyncMPClient]] = None,
        **client_kwargs: Any,
    ) -> None:
        # `clients`: already-connected per-core clients (private cores this frontend started) to route over.
        self.clients: list[SyncMPClient] = (
            list(clients) if clients is not None else _attach_all(SyncMPClient, addresses, auth_token, client_kwargs)
        )
        _init_from_clients(self, stats_interval_s)
        self._lock = threading.Lock()
        self._merged: queue.Queue[Union[EngineCoreOutputs, Exception]] = queue.Queue()
        self._closed = False
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
                    stats = client.call_utility("get_stats")
                except Exception:  # noqa: BLE001 -- a dead core is reported by its pump
                    return
                with self._lock:
                    self.router.set_load(core, stats)

    def _pump(self, core: int) -> None:
        """Move one core's outputs onto the merged queue, booking finishes and load on the way."""
        client = self.clients[core]
        while True:
            try:
                outs = client.get_output()
            except Exception as e:  # noqa: BLE001 -- death of any core ends this client
                if not self._closed:
                    self._merged.put(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))
                return
            with self._lock:
                self.router.observe(core, outs)
            outs.engine_index = core
            self._merged.put(outs)

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            core = self.router.route(request)
        try:
            self.clients[core].add_request(request)
        except BaseException:
            with self._lock:
                self.router.unroute(request.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            groups = self.router.group_by_core(request_ids)
        for core, ids in groups.items():
            self.clients[core].abort_requests(ids)

    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        try:
            item = self._merged.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"No engine core output within {timeout} s.") from None
        if isinstance(item, Exception):
            self._merged.put(item)
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        """Runs on every core; results combined by ``combine_utility_results``."""
        return combine_utility_results(method, [c.call_utility(method, *args) for c in self.clients])

    def core_for(self, request_id: str) -> Optional[int]:
        """The rank a live request was routed to (None once it finished)."""
        with self._lock:
            return self.router.owner.get(request_id)

    @property
    def is_dead(self) -> bool:
        return any(c.is_dead for c in self.clients)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for c in self.clients:
            c.shutdown()
        self._merged.put(EngineDeadError("This engine core client was shut down."))


class AsyncDPCoreClient(EngineCoreClient):
    """The asyncio version, for AsyncLLM and the HTTP frontends (one AsyncMPClient per core)."""

    def __init__(
        self,
        addresses: Sequence[str],
        auth_token: Optional[str] = None,
        stats_interval_s: float = 0.5,
        *,
        clients: Optional[Sequence[AsyncMPClient]] = None,
        **client_kwargs: Any,
    ) -> None:
        # `clients`: already-connected per-core clients (private cores this frontend started) to route over.
        self.clients: list[AsyncMPClient] = (
            list(clients) if clients is not None else _attach_all(AsyncMPClient, addresses, auth_token, client_kwargs)
        )
        _init_from_clients(self, stats_interval_s)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._merged: Optional[asyncio.Queue] = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def _ensure_started(self) -> None:
        if self._closed:
            raise EngineDeadError("This engine core client was shut down.")
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
                    self.router.set_load(core, await client.call_utility_async("get_stats"))
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
                if not self._closed:
                    merged.put_nowait(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))
                return
            self.router.observe(core, outs)
            outs.engine_index = core
            merged.put_nowait(outs)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_started()
        core = self.router.route(request)
        try:
            await self.clients[core].add_request_async(request)
        except BaseException:
            self.router.unroute(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._ensure_started()
        for core, ids in self.router.group_by_core(request_ids).items():
            await self.clients[core].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self._merged is not None
        item = await self._merged.get()
        if isinstance(item, Exception):
            self._merged.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Runs on every core; results combined by ``combine_utility_results``."""
        self._ensure_started()
        results = await asyncio.gather(*(c.call_utility_async(method, *args) for c in self.clients))
        return combine_utility_results(method, list(results))

    def core_for(self, request_id: str) -> Optional[int]:
        return self.router.owner.get(request_id)

    @property
    def is_dead(self) -> bool:
        return any(c.is_dead for c in self.clients)

    # The sync API would block the loop, as on AsyncMPClient.
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError("AsyncDPCoreClient: use await add_request_async().")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError("AsyncDPCoreClient: use await abort_requests_async().")

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("AsyncDPCoreClient: use await get_output_async().")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError("AsyncDPCoreClient: use await call_utility_async().")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                in_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                in_loop = False
            for task in self._tasks:
                task.cancel() if in_loop else loop.call_soon_threadsafe(task.cancel)
        for c in self.clients:
            c.shutdown()


def combine_utility_results(method: str, results: list[Any]) -> Any:
    """One answer from every core's: all true (ping, reset_prefix_cache), ``get_stats`` summed
    (each core's own under ``per_core``), ``get_num_*`` counts summed, else the list in rank order."""
    if results and all(isinstance(r, bool) for r in results):
        return all(results)
    if method == "get_stats":
        return _sum_stats(results)
    if method.startswith("get_num_") and all(isinstance(r, int) for r in results):
        return sum(results)
    return results


def _sum_stats(per_core: list[Any]) -> dict[str, Any]:
    """One stats dict for the HTTP layer: counts summed, usage averaged, step counter summed."""
    dicts = [d for d in per_core if isinstance(d, dict)]
    total: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    if dicts and "kv_cache_usage" in total:
        total["kv_cache_usage"] = total["kv_cache_usage"] / len(dicts)
    total["per_core"] = dicts
    return total
