"""The shared pieces of the engine-core clients: the interface's defaults, output queues, and the
request-id namespace an attached frontend uses in a core that others share."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

import pytest

from vllm_lite.client.client_base import (
    AsyncOnlyClient,
    EngineCoreClient,
    output_or_raise,
    take_output,
)
from vllm_lite.client.core_client import SyncMPClient
from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.client.request_ids import RequestIdNamespace
from vllm_lite.core.engine_core_proc import CoreProcOptions
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs
from vllm_lite.testing.fake_core import (
    FakeEngineCoreProc,
    fake_config,
    fake_token,
    make_addresses,
    request,
)


class _Minimal(EngineCoreClient):
    model_facts: dict[str, Any] = {}

    def add_request(self, request: Any) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def get_output(self) -> EngineCoreOutputs:
        return EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any) -> Any: ...
    def shutdown(self) -> None: ...


class _AsyncMinimal(AsyncOnlyClient):
    model_facts: dict[str, Any] = {}

    def shutdown(self) -> None: ...


def test_every_client_answers_what_callers_ask_without_probing():
    c = _Minimal()
    assert (c.is_dead, c.core_for("any"), c.client_index, c.model_path, c.tokenizer_path) == (False, 0, 0, None, None)
    with pytest.raises(NotImplementedError, match="synchronous"):
        asyncio.run(c.get_output_async())


def test_an_asyncio_client_refuses_the_blocking_api_by_name():
    c = _AsyncMinimal()
    for call in (
        lambda: c.add_request(None),
        lambda: c.abort_requests([]),
        c.get_output,
        lambda: c.call_utility("ping"),
    ):
        with pytest.raises(NotImplementedError, match="_AsyncMinimal: use await"):
            call()


def test_an_error_on_the_output_queue_is_raised_to_every_later_caller():
    q: queue.Queue = queue.Queue()
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1])])
    q.put(outs)
    q.put(EngineDeadError("gone"))
    assert take_output(q, timeout=1.0) is outs
    for _ in range(3):
        with pytest.raises(EngineDeadError, match="gone"):
            take_output(q, timeout=1.0)
    with pytest.raises(TimeoutError):
        take_output(queue.Queue(), timeout=0.01)
    kept: list = []
    assert output_or_raise(outs, kept.append) is outs and kept == []


def test_namespace_prefixes_outgoing_ids_without_touching_the_callers_request_and_strips_outputs():
    ns, other = RequestIdNamespace(), RequestIdNamespace()
    assert ns.prefix != other.prefix
    req = request("r0", [1, 2])
    sent = ns.request(req)
    assert req.request_id == "r0" and sent.request_id == ns.prefix + "r0" and sent.prompt_token_ids == [1, 2]
    assert ns.ids(["a", "b"]) == [ns.prefix + "a", ns.prefix + "b"]
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput(ns.prefix + "r0", [5]), EngineCoreOutput("foreign", [6])])
    assert [o.request_id for o in ns.strip(outs).outputs] == ["r0", "foreign"]


def _drain(client: SyncMPClient, rid: str, timeout_s: float = 30.0) -> list[int]:
    toks: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        for o in client.get_output(timeout=max(0.1, deadline - time.monotonic())).outputs:
            assert o.request_id == rid and o.error is None, o
            toks += o.new_token_ids
            if o.finished:
                return toks


def test_attached_frontends_may_use_the_same_request_id_in_one_core(tmp_path):
    # Slow steps (10 ms) keep both requests running at once: without namespaces the second is a duplicate.
    addresses = make_addresses(str(tmp_path))
    proc = FakeEngineCoreProc(fake_config(fake_step_delay=0.01), addresses, CoreProcOptions(heartbeat_timeout_s=None))
    loop = threading.Thread(target=proc.run_busy_loop, daemon=True)
    loop.start()
    clients = [SyncMPClient(addresses=addresses, namespace_request_ids=True) for _ in range(2)]
    try:
        for i, c in enumerate(clients):
            c.add_request(request("same", [3, i + 1], max_tokens=20))
        for i, c in enumerate(clients):
            assert _drain(c, "same") == [fake_token([3, i + 1], n) for n in range(20)]
    finally:
        for c in clients:
            c.shutdown()
        proc.request_shutdown()
        loop.join(10)
    assert not loop.is_alive()
