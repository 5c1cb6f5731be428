"""Fault injection against real `vllm-lite serve` processes, plus the abort soak and the tenant probe.

On the shared daemon: many streams cancelled at random points (then no request left, every
block free), kill -9 of an attached frontend (its blocks freed by the disconnect: the heartbeat
timeout is 600 s), and the cross-tenant cache probe. kill -9 of the core under load (attached
LLM -> EngineDeadError, an open SSE stream -> an error event and [DONE], /health -> 503) and
SIGTERM under load (streams end, exit 0) run in tests/test_serve_daemon.py, on the daemons of
its own that end that way anyway (one daemon start each instead of two). kill -9 of a
tensor-parallel rank is tests/test_tensor_parallel.py's (either rank of a TP=2 core on CPU ->
EngineDeadError, no rank left); benchmarks/soak.py does it to a serve daemon. Each test prints
what it measured (-s).
"""

from __future__ import annotations

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.abort_soak import abort_soak
from vllm_lite.testing.target_daemon import TargetDaemon, start_doomed_frontend

DEADLINE_S = 60.0
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
        child.kill()  # kill -9: no GOODBYE; the heartbeat timeout is 600 s
        # Well before the heartbeat timeout: only the disconnect can explain it (wait_clean raises past the deadline).
        took = target.wait_clean(DEADLINE_S)
        print(f"\n[frontend kill -9] 4 requests holding {total - free} blocks: all freed {took:.2f} s later")
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
