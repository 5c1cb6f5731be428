"""Fault injection against real `vllm-lite serve` processes, plus the abort soak and the tenant probe.

On the shared daemon: many streams cancelled at random points (then no request left, every
block free), kill -9 of an attached frontend (its blocks freed by the disconnect: the heartbeat
timeout is 600 s), and the cross-tenant cache probe. On daemons of their own: kill -9 of the
core under load (attached LLM -> EngineDeadError, an open SSE stream -> an error event and
[DONE], /health -> 503) and SIGTERM under load (streams end, exit 0). kill -9 of a
tensor-parallel rank is tests/test_tensor_parallel.py's (either rank of a TP=2 core on CPU ->
EngineDeadError, no rank left); benchmarks/soak.py does it to a serve daemon. Each test prints
what it measured (-s).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import httpx

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.abort_soak import abort_soak
from vllm_lite.testing.target_daemon import TargetDaemon, generate_until_death, start_doomed_frontend, stream_sse
from vllm_lite.testing.waiting import wait_until

DEADLINE_S = 60.0
# The old ways of noticing took 30 s (a dead core) and 10 s (a dead frontend): deadlines under them.
DEAD_CORE_DEADLINE_S = 20.0
SECRET = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)


def test_abort_soak_leaves_no_request_and_every_block_free(target: TargetDaemon) -> None:
    counts = abort_soak(target.base_url, streams=40, concurrency=8, seed=21)
    took = target.wait_clean()
    print(f"\n[abort soak] streams=40 {dict(counts)}; clean {took:.2f} s after the last cancel")
    assert sum(counts.values()) == 40 and not any(k.startswith("status-") for k in counts), counts
    assert counts["cancelled-mid-stream"] > 0
    target.assert_serves()


def test_a_killed_frontend_s_requests_end_and_blocks_free_without_the_heartbeat(target: TargetDaemon) -> None:
    child = start_doomed_frontend(target, num_requests=4)
    try:
        unfinished, free, total = target.blocks()
        assert unfinished >= 4 and free < total  # its requests hold blocks
        start = time.monotonic()
        child.kill()  # kill -9: no GOODBYE; the heartbeat timeout is 600 s
        took = target.wait_clean(DEADLINE_S)
        print(f"\n[frontend kill -9] 4 requests holding {total - free} blocks: all freed {took:.2f} s later")
        assert time.monotonic() - start < DEADLINE_S
    finally:
        child.kill()
        child.wait(30)
    target.assert_serves()


def test_a_second_tenant_guessing_a_prompt_sees_no_cached_tokens(target: TargetDaemon) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    victim = target.probe
    prober = LLM(engine_address=target.address, auth_token=target.token)
    try:
        victim.generate(SECRET, greedy, use_tqdm=False)
        own = victim.generate(SECRET, greedy, use_tqdm=False)[0].num_cached_tokens
        right = prober.generate(SECRET, greedy, use_tqdm=False)[0].num_cached_tokens
        wrong = prober.generate(SECRET.replace("fox", "cat"), greedy, use_tqdm=False)[0].num_cached_tokens
    finally:
        prober.shutdown()
    print(f"\n[tenant probe] victim's repeat {own} cached tokens; prober: right guess {right}, wrong guess {wrong}")
    assert own > 0  # the cache works for its owner
    assert right == wrong == 0  # and says nothing to another tenant


def test_kill_9_of_the_core_under_load_reaches_every_frontend() -> None:
    daemon = TargetDaemon()
    try:
        url = daemon.base_url + "/v1/completions"
        body = {"prompt": "The for statement", "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
        events: list[str] = []
        streaming, running = threading.Event(), threading.Event()
        result: dict[str, Any] = {}
        http = threading.Thread(target=stream_sse, args=(url, body, events, streaming), daemon=True)
        llm = threading.Thread(target=generate_until_death, args=(daemon.probe, result, running), daemon=True)
        http.start()
        llm.start()
        assert streaming.wait(DEADLINE_S) and running.wait(DEADLINE_S)
        killed = time.monotonic()
        os.kill(daemon.core_pid, signal.SIGKILL)
        llm.join(DEAD_CORE_DEADLINE_S)
        http.join(DEAD_CORE_DEADLINE_S)
        assert "dead_at" in result, f"no EngineDeadError within {DEAD_CORE_DEADLINE_S} s: {result}"
        assert not http.is_alive(), "the HTTP stream did not end"
        assert events[0] == "status 200" and events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2][len("data: ") :])["error"]
        wait_until(
            lambda: httpx.get(daemon.base_url + "/health", timeout=10).status_code == 503,
            DEADLINE_S,
            "/health answers 503",
        )
        print(
            f"\n[core kill -9] attached LLM: EngineDeadError after {result['dead_at'] - killed:.2f} s "
            f"({result['error'][:80]}); SSE error event {error['code']}; /health 503"
        )
        assert error["code"] == 503
    finally:
        daemon.stop()


def test_sigterm_under_load_ends_every_stream_and_exits_0() -> None:
    daemon = TargetDaemon()
    try:
        url = daemon.base_url + "/v1/completions"
        body = {"prompt": "The for statement", "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
        streams = [([], threading.Event()) for _ in range(3)]
        threads = [threading.Thread(target=stream_sse, args=(url, body, ev, st), daemon=True) for ev, st in streams]
        for t in threads:
            t.start()
        assert all(st.wait(DEADLINE_S) for _, st in streams)
        daemon.proc.send_signal(signal.SIGTERM)
        code = daemon.proc.wait(DEADLINE_S)
        for t in threads:
            t.join(DEADLINE_S)
        endings = [ev[-1] if ev else None for ev, _ in streams]
        print(f"\n[SIGTERM under load] exit code {code}; 3 streams ended with {endings}")
        assert code == 0
        assert not any(t.is_alive() for t in threads)
    finally:
        daemon.stop()
