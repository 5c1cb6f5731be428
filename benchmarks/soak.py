"""Soak: the reliability suite's attacks at volume against real `vllm-lite serve` processes.

    python benchmarks/soak.py                  # defaults: the issue's volumes (a few minutes)
    python benchmarks/soak.py --scale 2 ...    # smaller or larger

One daemon (core + HTTP frontend, tiny Llama, auth token, 600 s heartbeat timeout) takes the
ZMQ fuzzer (malformed, refused and never-HELLO peers, replays, foreign ABORTs, hostile ADDs,
oversized messages), floods of never-HELLO large ADDs and wrong-token HELLOs, the HTTP fuzzer
(hypothesis bodies, the issue's cases, non-JSON bodies, 10 MB and over-limit bodies), an abort
soak of cancelled streams, kill -9 of attached frontends and the cross-tenant probe. Then
daemons of their own for kill -9 of the core under load, of a tensor-parallel rank, and
SIGTERM under load. Prints ONE JSON line: cases per fuzzer, problems (crashes, 5xx, leaks:
all must be 0), times to EngineDeadError and to free a dead frontend's blocks, and RSS of
the core and the frontend before/after each flood. The host's load is part of the line: on a
shared machine the times are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

import httpx

from vllm_lite import LLM, SamplingParams
from vllm_lite.core.core_sockets import max_input_message_bytes
from vllm_lite.testing.abort_soak import abort_soak
from vllm_lite.testing.baselines import host_description
from vllm_lite.testing.http_fuzz import HttpFuzzer
from vllm_lite.testing.processes import process_gone, rank_children
from vllm_lite.testing.target_daemon import (
    MAX_MODEL_LEN,
    TargetDaemon,
    generate_until_death,
    rss_mb,
    start_doomed_frontend,
    stream_sse,
)
from vllm_lite.testing.waiting import wait_until
from vllm_lite.testing.zmq_fuzz import FuzzPeer, ZmqFuzzer, run_all

DEADLINE_S = 120.0


def _rss(daemon: TargetDaemon) -> dict[str, float]:
    fe = daemon.frontend_pids()
    return {"core_mb": round(rss_mb(daemon.core_pid), 1), "frontend_mb": round(rss_mb(fe[0]), 1) if fe else 0.0}


def _generate_s(daemon: TargetDaemon) -> float:
    start = time.monotonic()
    daemon.assert_serves(max_tokens=16)
    return round(time.monotonic() - start, 3)


def zmq_part(daemon: TargetDaemon, args: argparse.Namespace, out: dict[str, Any]) -> None:
    fuzzer = ZmqFuzzer(daemon.addresses, daemon.token, seed=args.seed)
    limit = max_input_message_bytes(MAX_MODEL_LEN, fuzzer.vocab)
    fuzzer.max_message_bytes = limit
    checks = {"n": 0}

    def after(_: str) -> None:
        daemon.assert_serves()
        daemon.wait_clean()
        checks["n"] += 1

    try:
        before = _rss(daemon)
        run_all(fuzzer, args.scale, after)
        out["zmq_fuzz"] = {
            "cases": fuzzer.report.cases,
            "by_kind": _kinds(fuzzer.report.tried),
            "outcomes": dict(fuzzer.report.outcomes),
            "problems": len(fuzzer.report.problems),
            "problem_examples": fuzzer.report.problems[:5],
            "health_checks_passed": checks["n"],
            "rss_before_after": [before, _rss(daemon)],
        }
        # Floods from peers that never said HELLO: under the size limit (never decoded) and over it.
        floods = {}
        for name, count, size in (
            ("never_hello_adds_under_limit", args.flood_adds, min(args.flood_add_mb << 20, limit - (1 << 20))),
            ("never_hello_adds_over_limit", max(1, args.flood_adds // 2), args.flood_add_mb << 20),
        ):
            gen_before, rss_before = _generate_s(daemon), _rss(daemon)
            start = time.monotonic()
            fuzzer.never_hello(count, size)
            daemon.wait_clean()
            floods[name] = {
                "messages": count,
                "bytes_each": size,
                "seconds": round(time.monotonic() - start, 2),
                "rss_before_after": [rss_before, _rss(daemon)],
                "real_client_generate_s_before_after": [gen_before, _generate_s(daemon)],
            }
        log_before = len(daemon.log())
        rss_before = _rss(daemon)
        start = time.monotonic()
        refused = 0
        for _ in range(args.hello_flood):
            peer = FuzzPeer(fuzzer.ctx, daemon.addresses, "intruder")
            reply = peer.greet("wrong-" + uuid.uuid4().hex[:8])
            refused += not reply.accepted
            peer.close()
        floods["wrong_token_hellos"] = {
            "messages": args.hello_flood,
            "refused": refused,
            "seconds": round(time.monotonic() - start, 2),
            "daemon_log_bytes_written": len(daemon.log()) - log_before,
            "rss_before_after": [rss_before, _rss(daemon)],
        }
        out["zmq_floods"] = floods
        out["problems"]["zmq"] = len(fuzzer.report.problems) + (refused != args.hello_flood)
    finally:
        fuzzer.close()


def _kinds(tried: Any) -> dict[str, int]:
    """Counts per attack family (the prefix before the first ':')."""
    fam: dict[str, int] = {}
    for key, n in tried.items():
        fam[key.split(":", 1)[0]] = fam.get(key.split(":", 1)[0], 0) + n
    return fam


def http_part(daemon: TargetDaemon, args: argparse.Namespace, out: dict[str, Any]) -> None:
    model = httpx.get(daemon.base_url + "/v1/models", timeout=60).json()["data"][0]["id"]
    fuzzer = HttpFuzzer(daemon.base_url, model)
    try:
        before = _rss(daemon)
        fuzzer.fuzz(args.http_examples, seed=args.seed)
        fuzzer.issue()
        fuzzer.raw()
        after_fuzz = _rss(daemon)
        from vllm_lite.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES

        under = fuzzer.huge_bodies(args.huge_bodies, 10 << 20, expect=400)
        after_10mb = _rss(daemon)
        over = fuzzer.huge_bodies(args.huge_bodies, DEFAULT_MAX_REQUEST_BODY_BYTES + 1, expect=413)
        daemon.wait_clean()
        daemon.assert_serves()
        out["http_fuzz"] = {
            "cases": fuzzer.report.cases,
            "outcomes": dict(fuzzer.report.outcomes),
            "problems": len(fuzzer.report.problems),
            "problem_examples": fuzzer.report.problems[:5],
            "rss_before_after_fuzz": [before, after_fuzz],
        }
        out["http_floods"] = {
            "bodies_10mb": {"count": len(under), "max_answer_s": round(max(under), 3), "status": 400},
            "bodies_over_limit": {
                "count": len(over),
                "bytes_each": DEFAULT_MAX_REQUEST_BODY_BYTES + 1,
                "max_answer_s": round(max(over), 3),
                "status": 413,
            },
            "rss_before_after_10mb": [after_fuzz, after_10mb],
            "rss_after_over_limit": _rss(daemon),
        }
        out["problems"]["http"] = len(fuzzer.report.problems)
    finally:
        fuzzer.close()


def abort_and_frontend_part(daemon: TargetDaemon, args: argparse.Namespace, out: dict[str, Any]) -> None:
    before = _rss(daemon)
    start = time.monotonic()
    counts = abort_soak(daemon.base_url, args.streams, concurrency=16, seed=args.seed)
    clean_s = daemon.wait_clean()
    _, free, total = daemon.blocks()
    out["abort_soak"] = {
        "streams": args.streams,
        "outcomes": dict(counts),
        "seconds": round(time.monotonic() - start, 2),
        "clean_after_s": round(clean_s, 3),
        "free_blocks": free,
        "total_blocks": total,
        "rss_before_after": [before, _rss(daemon)],
    }
    out["problems"]["abort_soak_leaks"] = int(free != total)
    frees = []
    for _ in range(args.frontend_kills):
        child = start_doomed_frontend(daemon, num_requests=4)
        os.kill(child.pid, signal.SIGKILL)
        frees.append(round(daemon.wait_clean(DEADLINE_S), 3))  # from right after the kill
        child.wait(30)
    out["frontend_kill_9_blocks_freed_s"] = frees
    prober = LLM(engine_address=daemon.address, auth_token=daemon.token)
    try:
        secret = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        daemon.probe.generate(secret, greedy, use_tqdm=False)
        own = daemon.probe.generate(secret, greedy, use_tqdm=False)[0].num_cached_tokens
        right = prober.generate(secret, greedy, use_tqdm=False)[0].num_cached_tokens
        wrong = prober.generate(secret.replace("fox", "cat"), greedy, use_tqdm=False)[0].num_cached_tokens
    finally:
        prober.shutdown()
    out["tenant_probe_cached_tokens"] = {"owner_repeat": own, "other_right_guess": right, "other_wrong_guess": wrong}
    out["problems"]["cross_tenant_signal"] = int(right != wrong)


def core_kill_part(out: dict[str, Any]) -> None:
    daemon = TargetDaemon()
    try:
        body = {"prompt": "The for statement", "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
        events: list[str] = []
        streaming, running = threading.Event(), threading.Event()
        result: dict[str, Any] = {}
        threading.Thread(
            target=stream_sse, args=(daemon.base_url + "/v1/completions", body, events, streaming), daemon=True
        ).start()
        llm = threading.Thread(target=generate_until_death, args=(daemon.probe, result, running), daemon=True)
        llm.start()
        streaming.wait(DEADLINE_S)
        running.wait(DEADLINE_S)
        killed = time.monotonic()
        os.kill(daemon.core_pid, signal.SIGKILL)
        llm.join(DEADLINE_S)
        wait_until(lambda: events and events[-1] == "data: [DONE]", DEADLINE_S, "the stream ends")
        stream_end = time.monotonic() - killed
        wait_until(
            lambda: httpx.get(daemon.base_url + "/health", timeout=10).status_code == 503, DEADLINE_S, "/health 503"
        )
        error = json.loads(events[-2][len("data: ") :]).get("error", {})
        out["core_kill_9"] = {
            "engine_dead_error_s": round(result["dead_at"] - killed, 3) if "dead_at" in result else None,
            "sse_stream_ended_s": round(stream_end, 3),
            "sse_error_code": error.get("code"),
            "health_503_after_s": round(time.monotonic() - killed, 3),
            "http_server_alive": daemon.proc.poll() is None,
        }
        out["problems"]["core_kill"] = int("dead_at" not in result or error.get("code") != 503)
    finally:
        daemon.stop()


def tp_rank_kill_part(out: dict[str, Any]) -> None:
    daemon = TargetDaemon(["--tensor-parallel-size", "2"], headless=True)
    try:
        ranks = rank_children(daemon.core_pid)
        result: dict[str, Any] = {}
        running = threading.Event()
        llm = threading.Thread(target=generate_until_death, args=(daemon.probe, result, running), daemon=True)
        llm.start()
        running.wait(DEADLINE_S)
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        llm.join(DEADLINE_S)
        code = daemon.proc.wait(DEADLINE_S)
        wait_until(lambda: all(process_gone(p) for p in ranks), DEADLINE_S, "no rank survives")
        out["tp_rank_kill_9"] = {
            "engine_dead_error_s": round(result["dead_at"] - killed, 3) if "dead_at" in result else None,
            "serve_exit_code": code,
        }
        out["problems"]["tp_rank_kill"] = int("dead_at" not in result)
    finally:
        daemon.stop()


def sigterm_part(out: dict[str, Any]) -> None:
    daemon = TargetDaemon()
    try:
        body = {"prompt": "The for statement", "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
        streams = [([], threading.Event()) for _ in range(4)]
        threads = [
            threading.Thread(target=stream_sse, args=(daemon.base_url + "/v1/completions", body, ev, st), daemon=True)
            for ev, st in streams
        ]
        for t in threads:
            t.start()
        for _, st in streams:
            st.wait(DEADLINE_S)
        start = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        code = daemon.proc.wait(DEADLINE_S)
        for t in threads:
            t.join(DEADLINE_S)
        out["sigterm_under_load"] = {
            "exit_code": code,
            "exit_s": round(time.monotonic() - start, 3),
            "streams_ended": sum(not t.is_alive() for t in threads),
            "stream_last_events": [ev[-1][:60] if ev else None for ev, _ in streams],
        }
        out["problems"]["sigterm"] = int(code != 0)
    finally:
        daemon.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=int, default=10, help="ZMQ fuzz rounds (1 = the CI test's volume)")
    p.add_argument("--http-examples", type=int, default=150, help="hypothesis bodies per endpoint")
    p.add_argument("--streams", type=int, default=300, help="cancelled streams in the abort soak")
    p.add_argument("--flood-adds", type=int, default=20, help="never-HELLO large ADDs per flood")
    p.add_argument("--flood-add-mb", type=int, default=40, help="size of each flooded ADD (MB)")
    p.add_argument("--hello-flood", type=int, default=2000, help="wrong-token HELLOs")
    p.add_argument("--huge-bodies", type=int, default=10, help="10 MB and over-limit HTTP bodies each")
    p.add_argument("--frontend-kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=21)
    args = p.parse_args()
    load_before = os.getloadavg()
    out: dict[str, Any] = {
        "benchmark": "soak",
        "host": {
            **host_description(),
            "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in load_before],
            "note": "shared machine, loaded by other work: times are upper bounds",
        },
        "problems": {},
    }
    start = time.monotonic()
    daemon = TargetDaemon()
    try:
        daemon.assert_serves()
        out["rss_at_start"] = _rss(daemon)
        zmq_part(daemon, args, out)
        http_part(daemon, args, out)
        abort_and_frontend_part(daemon, args, out)
        out["rss_at_end"] = _rss(daemon)
        out["problems"]["shared_daemon_alive"] = int(daemon.proc.poll() is not None)
    finally:
        daemon.stop()
    core_kill_part(out)
    tp_rank_kill_part(out)
    sigterm_part(out)
    out["host"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["total_problems"] = sum(out["problems"].values())
    out["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(out))
    return 0 if out["total_problems"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
