"""Data-parallel routing decisions, with no I/O: which core a new request goes to, and how the
answers of several cores to one utility call become one.

Rules (``Router.route``):

* sticky: a request whose first prompt block (``block_size`` tokens) was seen before goes to
  the core that served it, so shared prefixes (a chat's follow-ups, a common system prompt)
  hit that core's prefix cache;
* otherwise least-loaded: the core with the fewest requests this frontend has in flight there
  plus the running + waiting requests its latest scheduler stats report (which include other
  frontends' work). A sticky core much busier than the least-loaded one (``sticky_slack``)
  loses the prefix to it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Optional, Sequence

from vllm_lite.core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

# How many first-block hashes a router remembers (LRU) for sticky routing.
_MAX_STICKY_PREFIXES = 65536


class Router:
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


def merged_facts(clients: Sequence[Any]) -> dict[str, Any]:
    """One set of model facts for D cores, which must serve the same model (the smallest KV size counts)."""
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
