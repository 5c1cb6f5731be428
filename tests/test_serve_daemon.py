"""`vllm-lite serve`: a real daemon process with real frontend processes attached (Python and HTTP).

Every daemon here is `python -m vllm_lite.entrypoints.cli serve ...` on a tiny random
checkpoint; frontends are separate Python processes (LLMEngine.attach), the daemon's
own HTTP frontends, and this test process. Greedy outputs are checked against
LLM(multiprocess=False) on the same checkpoint.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from vllm_lite import LLM, SamplingParams
from vllm_lite.client.core_client import SyncMPClient
from vllm_lite.client.exceptions import EngineHandshakeError
from vllm_lite.client.llm_engine import LLMEngine
from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutputType,
    EngineCoreRequestType,
    HandshakeReply,
    HelloRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.entrypoints.serve_daemon import check_bind_allowed, is_loopback_host
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.processes import children, launched_as, process_gone
from vllm_lite.testing.serve_process import ServeProcess
from vllm_lite.testing.target_daemon import generate_until_death, stream_sse
from vllm_lite.testing.waiting import wait_until

TOKEN = "s3cret-token"
HEARTBEAT_S = 2.0
# Generous: a loaded 2-core machine only makes these tests slower, never wrong.
DEADLINE_S = 60.0
# The old ways of noticing a dead core took 30 s: a deadline under it.
DEAD_CORE_DEADLINE_S = 20.0
PROMPTS_A = ["The for statement", "Hello world, this is frontend A", "def f(x): return"]
PROMPTS_B = ["Exceptions are raised", "while True:", "class Foo(object):", "import sys"]
PROMPTS_HTTP = ["The with statement", "Lambda expressions"]
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)  # many full KV blocks


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory) -> str:
    """The tiny llama with room for 8k positions: a frontend's long requests outlive the heartbeat timeout."""
    src = get_checkpoint("llama")
    dst = str(tmp_path_factory.mktemp("serve") / "llama-8k")
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 8192
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.fixture(scope="module")
def reference(long_ckpt):
    """Greedy token ids and texts from an in-process engine (the oracle for every frontend)."""
    llm = LLM(long_ckpt, multiprocess=False, dtype="float32")
    cache: dict[tuple[str, int], tuple[list[int], str]] = {}

    def get(prompt: str, max_tokens: int) -> tuple[list[int], str]:
        key = (prompt, max_tokens)
        if key not in cache:
            out = llm.generate(prompt, greedy(max_tokens), use_tqdm=False)[0].outputs[0]
            cache[key] = (list(out.token_ids), out.text)
        return cache[key]

    yield get
    llm.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Daemon(ServeProcess):
    """A `vllm-lite serve` process (float32) with its stderr in a file, shown when a wait fails."""

    def __init__(self, args: list[str], log_path: str, env: Optional[dict[str, str]] = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        # float32: outputs are compared with an in-process float32 reference.
        super().__init__([*args, "--dtype", "float32"], {**os.environ, **(env or {})}, stderr=self._log)

    def expect_line(self, needle: str, timeout: float = 120.0) -> str:
        return self.line_with(needle, timeout)

    def diagnostics(self) -> str:
        return super().diagnostics() + "\n--- stderr ---\n" + self.log()

    def core_line(self) -> tuple[str, str]:
        """(the core's address, its whole 'listening on' line), once it serves (`--port 0` picks the port)."""
        line = self.expect_line("vllm-lite engine core listening on")
        return line.split(" listening on ", 1)[1].split(" ", 1)[0], line

    def api_url(self) -> tuple[str, str]:
        """(the HTTP frontends' base URL, their whole line), once they serve (`--api-port 0` picks the port)."""
        line = self.expect_line("vllm-lite OpenAI API on")
        return line.split(" OpenAI API on ", 1)[1].split(" ", 1)[0], line

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        super().stop()
        self._log.close()


# A frontend process: attaches, waits for "go" on stdin, sends its prompts, reports every output it received.
FRONTEND_SCRIPT = r"""
import json, sys
import torch
torch.set_num_threads(1)
from vllm_lite.client.llm_engine import LLMEngine
from vllm_lite.sampling_params import SamplingParams

spec = json.loads(sys.argv[1])
eng = LLMEngine.attach(spec["address"], spec["token"], client_name=spec["name"])
raw_ids = set()
get_output = eng.engine_core.get_output
def spy(*a, **k):
    outs = get_output(*a, **k)
    raw_ids.update(o.request_id for o in outs.outputs)
    return outs
eng.engine_core.get_output = spy
print(json.dumps({"event": "attached"}), flush=True)
sys.stdin.readline()
ids = []
for i, prompt in enumerate(spec["prompts"]):
    rid = f"req-{i}"  # the same ids in every frontend: the core keeps them apart
    eng.add_request(rid, prompt, SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True))
    ids.append(rid)
results, announced = {}, False
while eng.has_unfinished_requests():
    for out in eng.step():
        if not announced:
            print(json.dumps({"event": "streaming"}), flush=True)
            announced = True
        if out.finished:
            results[out.request_id] = {"token_ids": list(out.outputs[0].token_ids),
                                       "finish_reason": out.outputs[0].finish_reason,
                                       "cached": out.num_cached_tokens}
print(json.dumps({"event": "done", "raw_ids": sorted(raw_ids), "results": results}), flush=True)
eng.shutdown()
"""


class Frontend:
    def __init__(self, name: str, address: str, prompts: list[str], max_tokens: int, token: str = TOKEN) -> None:
        spec = {"name": name, "address": address, "token": token, "prompts": prompts, "max_tokens": max_tokens}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FRONTEND_SCRIPT, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def expect(self, event: str, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError(f"frontend exited with {self.proc.returncode} before {event!r}") from None
                continue
            if msg["event"] == event:
                return msg
        raise AssertionError(f"frontend did not report {event!r} within {timeout} s")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _attach_refused_as_shutting_down(address: str) -> bool:
    """Try to attach: True if the core refuses because it is shutting down; an accepted attach detaches again."""
    try:
        LLMEngine.attach(address, handshake_timeout_s=5).shutdown()
    except EngineHandshakeError as e:
        assert "shutting down" in str(e), e
        return True
    return False


def http_complete(base_url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(
        f"{base_url}/v1/completions",
        timeout=60.0,
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------- the shared daemon


@pytest.fixture(scope="module")
def daemon(long_ckpt, tmp_path_factory):
    # Its temp dirs in one of our own (TMPDIR; short, as socket paths must be), so the kill test can look in it.
    tmpdir = tempfile.mkdtemp(prefix="vl-serve-")
    d = Daemon(
        [
            long_ckpt,
            "--port",
            "0",
            "--auth-token",
            TOKEN,
            "--heartbeat-timeout",
            str(HEARTBEAT_S),
            "--api-port",
            "0",
            "--num-threads",
            "1",
            "--shutdown-timeout",
            "5",
            "--prefix-caching-scope",  # the frontends here trust each other (the default isolates them)
            "shared",
        ],
        str(tmp_path_factory.mktemp("serve-log") / "daemon.log"),
        env={"TMPDIR": tmpdir},
    )
    d.tmpdir = tmpdir
    try:
        d.address, d.listening = d.core_line()
        d.base_url, _ = d.api_url()
        yield d
    finally:
        d.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.fixture
def probe(daemon):
    """This test process attached too: utility calls (free blocks, frontends) straight to the core."""
    client = SyncMPClient(addresses=CoreAddresses.from_base(daemon.address), auth_token=TOKEN, client_name="probe")
    yield client
    client.shutdown()


def test_serve_prints_where_it_listens_with_model_and_kv_blocks(daemon, long_ckpt):
    line = daemon.listening
    assert line.startswith(f"vllm-lite engine core listening on {daemon.address} (model {long_ckpt}, ")
    assert " KV blocks of 16 tokens" in line


def test_two_python_frontends_and_http_share_the_core_each_sees_only_its_own_outputs_and_kill_9_frees_blocks(
    daemon, probe, reference
):
    a = Frontend("frontend-a", daemon.address, PROMPTS_A, max_tokens=24)
    b = Frontend("frontend-b", daemon.address, PROMPTS_B, max_tokens=24)
    # The victim streams 4 requests of 6000 tokens: left alone they would run for many seconds.
    k = Frontend("victim", daemon.address, ["Hello"] * 4, max_tokens=6000)
    try:
        for f in (a, b, k):
            f.expect("attached")
        names = sorted(f["name"] for f in probe.call_utility("list_frontends"))
        assert {"frontend-a", "frontend-b", "victim", "probe"} <= set(names)
        assert any(n.startswith("http") for n in names)  # the daemon's own HTTP frontend

        total = probe.call_utility("get_num_total_blocks")
        k.go()
        k.expect("streaming")
        assert probe.call_utility("get_num_free_blocks") < total  # the victim holds blocks now

        # Everyone at once: A, B and two HTTP requests run while the victim is killed mid-stream.
        with ThreadPoolExecutor(len(PROMPTS_HTTP)) as pool:
            a.go()
            b.go()
            http = [pool.submit(http_complete, daemon.base_url, p, 24) for p in PROMPTS_HTTP]
            k.proc.kill()  # kill -9: no GOODBYE, just silence
            texts = [f.result(timeout=60) for f in http]
        done_a, done_b = a.expect("done"), b.expect("done")

        # The victim's requests were aborted and every block came back (the heartbeat watch dropped it).
        wait_until(
            lambda: (
                probe.call_utility("get_num_unfinished_requests") == 0
                and probe.call_utility("get_num_free_blocks") == total
            ),
            DEADLINE_S,
            "the killed frontend's blocks are freed",
        )
        assert "victim" not in [f["name"] for f in probe.call_utility("list_frontends")]
        assert "Dropping frontend 'victim'" in daemon.log()

        # Each frontend got outputs for its own requests only, all complete and equal to the oracle.
        for done, prompts in ((done_a, PROMPTS_A), (done_b, PROMPTS_B)):
            ids = [f"req-{i}" for i in range(len(prompts))]
            assert done["raw_ids"] == sorted(ids)
            for rid, prompt in zip(ids, prompts):
                got = done["results"][rid]
                assert got["finish_reason"] == "length"
                assert got["token_ids"] == reference(prompt, 24)[0], (rid, prompt)
        for prompt, text in zip(PROMPTS_HTTP, texts):
            assert text == reference(prompt, 24)[1]
    finally:
        for f in (a, b, k):
            f.close()


def test_prefix_cache_is_shared_between_frontends(daemon, reference):
    first = Frontend("prefix-first", daemon.address, [LONG_PROMPT], max_tokens=4)
    try:
        first.expect("attached")
        first.go()
        res = first.expect("done")["results"]["req-0"]
        assert res["token_ids"] == reference(LONG_PROMPT, 4)[0]
    finally:
        first.close()
    # A different frontend (this process) sends the same long prompt: its blocks are already cached.
    llm = LLM(engine_address=daemon.address, auth_token=TOKEN)
    try:
        out = llm.generate(LONG_PROMPT, greedy(4), use_tqdm=False)[0]
        n_prompt = len(out.prompt_token_ids)
        assert n_prompt >= 64
        assert out.num_cached_tokens >= 16 * ((n_prompt - 1) // 16) > 0
        assert list(out.outputs[0].token_ids) == reference(LONG_PROMPT, 4)[0]
    finally:
        llm.shutdown()


def test_wrong_or_missing_token_is_refused_with_a_clear_error_and_a_daemon_log_line(daemon):
    with pytest.raises(EngineHandshakeError, match="refused this frontend: wrong auth token"):
        LLMEngine.attach(daemon.address, "not-the-token", client_name="intruder")
    with pytest.raises(EngineHandshakeError, match="wrong auth token"):
        LLM(engine_address=daemon.address)
    wait_until(lambda: "Refused frontend 'intruder'" in daemon.log(), DEADLINE_S, "the refusal log line")
    assert "wrong auth token" in daemon.log()


def test_wrong_protocol_version_is_refused_with_a_reason(daemon):
    ctx = zmq.Context()
    addrs = CoreAddresses.from_base(daemon.address)
    ident = os.urandom(16)
    socks = []
    try:
        for addr in (addrs.output, addrs.input):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, ident)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            socks.append(s)
        out, inp = socks
        hello = HelloRequest(protocol_version=PROTOCOL_VERSION + 100, auth_token=TOKEN, client_name="old-frontend")
        inp.send_multipart([EngineCoreRequestType.HELLO.value, msgspec.msgpack.encode(hello)])
        assert out.poll(10_000), "no handshake reply"
        frames = out.recv_multipart()
        assert frames[0] == EngineCoreOutputType.REFUSED.value
        reply = msgspec.msgpack.decode(frames[1], type=HandshakeReply)
        assert not reply.accepted and "protocol version mismatch" in reply.reason
    finally:
        for s in socks:
            s.close()
        ctx.term()
    wait_until(lambda: "Refused frontend 'old-frontend'" in daemon.log(), DEADLINE_S, "the refusal log line")


def test_llm_with_engine_address_rejects_engine_arguments(daemon):
    with pytest.raises(TypeError, match="fixed by the daemon"):
        LLM(engine_address=daemon.address, auth_token=TOKEN, max_model_len=128)


# ---------------------------------------------------------------------------------------------- bind policy


def test_loopback_detection():
    assert is_loopback_host("127.0.0.1") and is_loopback_host("127.3.2.1") and is_loopback_host("::1")
    assert is_loopback_host("localhost") and is_loopback_host("[::1]")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("10.1.2.3") and not is_loopback_host("::")
    check_bind_allowed("tcp://127.0.0.1:5000", None)
    check_bind_allowed("ipc:///tmp/x", None)
    check_bind_allowed("tcp://0.0.0.0:5000", "tok")
    with pytest.raises(ValueError, match="without an auth token"):
        check_bind_allowed("tcp://0.0.0.0:5000", None)


def test_serve_refuses_a_non_loopback_bind_without_a_token(long_ckpt, capsys, monkeypatch):
    # In this process, as the bad-flag tests below: the refusal comes at argument checking, before any child starts.
    from vllm_lite.entrypoints.cli import main

    monkeypatch.delenv("VLLM_LITE_AUTH_TOKEN", raising=False)
    flags = ["--core-host", "0.0.0.0", "--core-port", "0", "--headless", "--dtype", "float32"]
    assert main(["serve", long_ckpt, *flags]) == 2
    out, err = capsys.readouterr()
    assert "refusing to bind the engine core to '0.0.0.0' without an auth token" in err
    assert "listening" not in out  # refused before any model loads


# ---------------------------------------------------------------------------------------------- lifecycle


def test_sigterm_drains_running_requests_aborts_past_the_timeout_and_exits_0(long_ckpt, tmp_path, reference):
    d = Daemon(
        [long_ckpt, "--core-port", "0", "--headless", "--num-threads", "1", "--shutdown-timeout", "3"],
        str(tmp_path / "daemon.log"),
    )
    try:
        address, _ = d.core_line()
        eng = LLMEngine.attach(address)
        try:
            eng.add_request("short", "The for statement", greedy(200))
            eng.add_request("endless", "Hello", greedy(7000))  # far more than 3 s of decoding
            outs: dict[str, Any] = {}
            first = True
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if first:
                        d.proc.send_signal(signal.SIGTERM)
                        first = False
                        # Draining: running requests go on, but nobody new gets in.
                        wait_until(
                            lambda: _attach_refused_as_shutting_down(address),
                            DEADLINE_S,
                            "a new frontend is refused while draining",
                            interval_s=0.1,
                        )
                    if out.finished:
                        outs[out.request_id] = out
            # The short one drained to its end; the endless one was aborted at the drain deadline.
            assert outs["short"].outputs[0].finish_reason == "length"
            assert list(outs["short"].outputs[0].token_ids) == reference("The for statement", 200)[0]
            assert outs["endless"].outputs[0].finish_reason == "abort"
            assert len(outs["endless"].outputs[0].token_ids) < 7000
            assert d.proc.wait(DEADLINE_S) == 0
        finally:
            eng.shutdown()
        assert "draining running requests for up to 3.0 s" in d.log()
    finally:
        d.stop()


def test_two_http_frontends_share_one_port_and_a_core_killed_under_load_reaches_every_frontend_then_ends_all(
    long_ckpt, tmp_path, reference
):
    """kill -9 of the core while an attached LLM and an SSE stream run: the LLM gets EngineDeadError, the stream an
    error event and [DONE], /health 503; then the supervisor takes everything down with a non-zero exit."""
    d = Daemon(
        [long_ckpt, "--port", "0", "--api-port", "0", "--api-servers", "2", "--num-threads", "1"],
        str(tmp_path / "daemon.log"),
    )
    llm = None
    try:
        address, line = d.core_line()
        base_url, api_line = d.api_url()
        assert "(2 HTTP frontends sharing the port)" in api_line
        core_pid = int(line.rsplit("pid ", 1)[1].rstrip(")"))
        probe = SyncMPClient(addresses=CoreAddresses.from_base(address), client_name="probe")
        try:
            names = sorted(f["name"] for f in probe.call_utility("list_frontends"))
            assert names == ["http-0", "http-1", "probe"]
        finally:
            probe.shutdown()
        prompts = (PROMPTS_A + PROMPTS_B)[:6]
        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(lambda p: http_complete(base_url, p, 16), prompts))
        assert texts == [reference(p, 16)[1] for p in prompts]
        frontends = [p for p in children(d.proc.pid) if launched_as(p, "vllm_lite.entrypoints.serve_frontend", "http-")]
        assert len(frontends) == 2

        # Under load: an attached LLM in this process and an SSE stream, both mid-generation at the kill.
        llm = LLM(engine_address=address)
        body = {"prompt": "The for statement", "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}
        events: list[str] = []
        streaming, running = threading.Event(), threading.Event()
        result: dict[str, Any] = {}
        http = threading.Thread(
            target=stream_sse, args=(base_url + "/v1/completions", body, events, streaming), daemon=True
        )
        gen = threading.Thread(target=generate_until_death, args=(llm, result, running), daemon=True)
        http.start()
        gen.start()
        assert streaming.wait(DEADLINE_S) and running.wait(DEADLINE_S)
        os.kill(core_pid, signal.SIGKILL)
        gen.join(DEAD_CORE_DEADLINE_S)
        http.join(DEAD_CORE_DEADLINE_S)
        assert "dead_at" in result, f"no EngineDeadError within {DEAD_CORE_DEADLINE_S} s: {result}"
        assert not http.is_alive(), "the HTTP stream did not end"
        assert events[0] == "status 200" and events[-1] == "data: [DONE]", events[-3:]
        assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 503
        wait_until(
            lambda: httpx.get(base_url + "/health", timeout=10).status_code == 503, DEADLINE_S, "/health answers 503"
        )

        code = d.proc.wait(30)
        assert code != 0
        assert all(process_gone(p) for p in frontends)
        log = d.log()
        assert "Engine core 0 exited unexpectedly" in log
        assert "HTTP frontend 0 exited with code 1" in log and "HTTP frontend 1 exited with code 1" in log
    finally:
        if llm is not None:
            llm.shutdown()
        d.stop()


def _metric_sums(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus samples summed by name and labels (model_name left out)."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_bundled_default_on_ipc_two_api_servers_metrics_sum_and_sigterm_under_load_exits_0(tmp_path):
    """The bundled model on an ipc:// core with --api-server-count 2: any one /metrics scrape sums both frontends
    (prometheus multiprocess mode); SIGTERM while three streams run ends every stream and exits 0, cleanly."""
    from vllm_lite.default_model import DEFAULT_MODEL_NAME

    address = f"ipc://{tmp_path}/core"
    d = Daemon(
        [
            "--address",
            address,
            "--api-port",
            "0",
            "--api-server-count",
            "2",
            "--num-threads",
            "1",
            "--shutdown-timeout",
            "5",
        ],
        str(tmp_path / "d.log"),
    )
    try:
        _, line = d.core_line()
        assert line.startswith(f"vllm-lite engine core listening on {address} (model {DEFAULT_MODEL_NAME}, ")
        base_url, _ = d.api_url()
        sent = 8
        for i in range(sent):  # a fresh connection each: the kernel spreads them over both frontends
            r = httpx.post(
                f"{base_url}/v1/completions",
                timeout=60.0,
                json={"prompt": f"Request {i}", "max_tokens": 2, "temperature": 0.0, "ignore_eos": True},
            )
            assert r.status_code == 200 and r.json()["model"] == DEFAULT_MODEL_NAME, r.text
        for _ in range(4):  # whichever frontend answers the scrape, it reports everyone's requests
            values = _metric_sums(httpx.get(f"{base_url}/metrics", timeout=60).text)
            assert values[("vllm:request_success_total", (("finished_reason", "length"),))] == sent
            assert values[("vllm:http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == sent
            assert values[("vllm:e2e_request_latency_seconds_count", ())] == sent
        with LLM(engine_address=address) as llm:
            assert len(llm.generate("Hello", greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3

        # SIGTERM under load: three streams (longer than the 5 s drain) are running.
        body = {"prompt": "The for statement", "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        streams: list[tuple[list[str], threading.Event]] = [([], threading.Event()) for _ in range(3)]
        threads = [
            threading.Thread(target=stream_sse, args=(f"{base_url}/v1/completions", body, ev, st), daemon=True)
            for ev, st in streams
        ]
        for t in threads:
            t.start()
        assert all(st.wait(DEADLINE_S) for _, st in streams)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(DEADLINE_S) == 0
        for t in threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads), "a stream did not end"
        log = d.log()
        # The frontends knew the core's exit was on purpose: clean exits, no "engine died".
        assert "HTTP frontend 0 exited with code 0" in log and "HTTP frontend 1 exited with code 0" in log
        assert "engine died" not in log
    finally:
        d.stop()


def test_killing_the_serve_process_leaves_no_core_or_frontend_behind(daemon):
    """Kills the module's daemon (a core and one HTTP frontend), so it stays the last test that uses it:
    one serve start fewer than a daemon of its own (the fixture's stop accepts a dead process)."""
    core_pid = int(daemon.listening.rsplit("pid ", 1)[1].rstrip(")"))
    frontends = [
        p for p in children(daemon.proc.pid) if launched_as(p, "vllm_lite.entrypoints.serve_frontend", "http-")
    ]
    assert len(frontends) == 1
    # The frontends' prometheus multiprocess dir (the supervisor's temp dir): removed by the orphans, since the
    # killed supervisor cannot (one such dir leaked per test-suite run).
    made = [p for p in os.listdir(daemon.tmpdir) if p.startswith("vllm-lite-")]
    assert len(made) == 1 and made[0].startswith("vllm-lite-metrics-"), made
    daemon.proc.kill()
    daemon.proc.wait(10)
    wait_until(
        lambda: process_gone(core_pid) and all(process_gone(p) for p in frontends), DEADLINE_S, "the orphans exit"
    )
    assert [p for p in os.listdir(daemon.tmpdir) if p.startswith("vllm-lite-")] == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--core-address", "tcp://127.0.0.1:7000", "--core-port", "7000"],
            "either --core-address or --core-host/--core-port",
        ),
        (["--api-port", "8000", "--api-servers", "0"], "api_servers must be a positive integer"),
        (["--data-parallel-size", "0"], "--data-parallel-size must be at least 1"),
        (["--address", "http://127.0.0.1:7000"], "engine address must be tcp://HOST:PORT or ipc:///PATH"),
        (["--core-port", "65534", "--data-parallel-size", "2"], "need ports up to 65537"),
        (["--api-port", "0", "--core-port", "0"], "old spellings of --port/--host"),
    ],
)
def test_serve_rejects_bad_flags_before_starting_anything(long_ckpt, capsys, flags, message):
    from vllm_lite.entrypoints.cli import main

    assert main(["serve", long_ckpt, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-lite serve: error: ") and message in err
