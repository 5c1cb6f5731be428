"""Data parallel serving: `vllm-lite serve --data-parallel-size 2` and the routing DP clients.

Router rules are checked directly (no processes); then one real daemon with two
engine cores serves a Python frontend and an HTTP frontend: requests spread over
both cores (each core's own stats show it stepped), shared prefixes stick to one
core (its prefix cache hits), and greedy outputs equal LLM(multiprocess=False).
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.client.core_client import SyncMPClient
from vllm_lite.client.dp_client import _Router, combine_utility_results
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm_lite.endpoints import CoreAddresses, dp_core_addresses, split_addresses
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.devices import requires_cuda_devices

PROMPTS = [
    "The for statement",
    "Hello world",
    "def f(x): return",
    "Exceptions are raised",
    "while True:",
    "class Foo(object):",
    "import sys",
    "The with statement",
]
PREFIXES = [f"Topic {i}: " + " ".join(["the quick brown fox jumps over the lazy dog"] * 4) for i in range(4)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------------------------- routing rules


def req(rid: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(rid, tokens, greedy(4), None, 0.0)


def test_dp_core_addresses_give_each_rank_its_own_socket_pair():
    assert dp_core_addresses("tcp://127.0.0.1:9000", 1) == ["tcp://127.0.0.1:9000"]
    assert dp_core_addresses("tcp://127.0.0.1:9000", 3) == [
        "tcp://127.0.0.1:9000",
        "tcp://127.0.0.1:9002",
        "tcp://127.0.0.1:9004",
    ]
    assert dp_core_addresses("ipc:///tmp/core", 2) == ["ipc:///tmp/core", "ipc:///tmp/core-dp1"]
    assert split_addresses("tcp://h:1000,tcp://h:2000") == ["tcp://h:1000", "tcp://h:2000"]
    assert split_addresses("tcp://h:1000", 2) == ["tcp://h:1000", "tcp://h:1002"]
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        dp_core_addresses("tcp://h:1000", 0)
    with pytest.raises(ValueError, match="65535"):
        dp_core_addresses("tcp://h:65530", 4)
    with pytest.raises(ValueError, match="tcp://HOST:PORT or ipc"):
        split_addresses("http://h:1000")
    with pytest.raises(ValueError, match="2 engine addresses but data_parallel_size=3"):
        split_addresses("tcp://h:1000,tcp://h:2000", 3)


def test_router_spreads_new_prefixes_to_the_least_loaded_core():
    r = _Router(2, block_size=4)
    cores = [r.route(req(f"r{i}", [i, i, i, i, i])) for i in range(6)]
    assert sorted(cores) == [0, 0, 0, 1, 1, 1]  # alternates: each core gets the next when it is lighter
    r.set_load(0, {"num_running_reqs": 10, "num_waiting_reqs": 5})  # other frontends keep core 0 busy
    assert [r.route(req(f"s{i}", [100 + i] * 5)) for i in range(3)] == [1, 1, 1]


def test_router_keeps_a_shared_first_block_on_one_core_and_books_finishes():
    r = _Router(2, block_size=4)
    first = r.route(req("a", [7, 7, 7, 7, 1]))
    r.set_load(first, {"num_running_reqs": 3})
    assert r.route(req("b", [7, 7, 7, 7, 2, 3])) == first  # same first block, though that core is busier
    assert r.route(req("short", [7, 7])) != first  # shorter than a block: plain least-loaded
    assert r.in_flight[first] == 2
    done = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH), EngineCoreOutput("b", [6])]
    )
    r.observe(first, done)
    assert r.in_flight[first] == 1 and "a" not in r.owner and r.owner["b"] == first
    assert r.group_by_core(["b", "short", "unknown"]) == {first: ["b"], 1 - first: ["short"]}


def test_router_rehomes_a_prefix_whose_core_is_far_busier():
    r = _Router(2, block_size=4, sticky_slack=8)
    first = r.route(req("a", [1, 2, 3, 4]))
    r.set_load(first, {"num_running_reqs": 20})
    moved = r.route(req("b", [1, 2, 3, 4]))
    assert moved != first
    assert r.route(req("c", [1, 2, 3, 4])) == moved  # the prefix lives there now


def test_utility_results_from_all_cores_combine():
    assert combine_utility_results("ping", [True, True]) is True
    assert combine_utility_results("reset_prefix_cache", [True, False]) is False
    assert combine_utility_results("get_num_free_blocks", [10, 20]) == 30
    stats = combine_utility_results(
        "get_stats",
        [
            {"num_running_reqs": 1, "kv_cache_usage": 0.2, "step_counter": 5},
            {"num_running_reqs": 2, "kv_cache_usage": 0.4, "step_counter": 7},
        ],
    )
    assert stats["num_running_reqs"] == 3 and stats["step_counter"] == 12
    assert stats["kv_cache_usage"] == pytest.approx(0.3) and len(stats["per_core"]) == 2
    assert combine_utility_results("get_model_facts", [{"a": 1}, {"a": 1}]) == [{"a": 1}, {"a": 1}]


# ---------------------------------------------------------------------------------------------- a real DP daemon


@pytest.fixture(scope="module")
def ckpt() -> str:
    return get_checkpoint("llama")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=requires_cuda_devices(2))])
def dp_device(request) -> str:
    """CPU cores run everywhere; CUDA data parallelism puts each core on its own device (cuda:r)."""
    return request.param


@pytest.fixture(scope="module")
def reference(ckpt, dp_device):
    llm = LLM(ckpt, multiprocess=False, dtype="float32", device=dp_device)
    cache: dict = {}

    def get(prompt: str, n: int):
        if (prompt, n) not in cache:
            out = llm.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0]
            cache[(prompt, n)] = (list(out.token_ids), out.text)
        return cache[(prompt, n)]

    yield get
    llm.shutdown()


@pytest.fixture(scope="module")
def dp_daemon(ckpt, dp_device, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("dp") / "serve.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_lite.entrypoints.cli",
            "serve",
            ckpt,
            "--data-parallel-size",
            "2",
            "--port",
            "0",
            "--api-port",
            "0",
            "--num-threads",
            "1",
            "--heartbeat-timeout",
            "3",
            "--dtype",
            "float32",
            "--device",
            dp_device,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.rstrip()) for x in proc.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 180
    while not any("OpenAI API on" in x for x in seen):
        assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{open(log_path).read()}"
        assert time.monotonic() < deadline, "DP daemon did not start"
        try:
            seen.append(lines.get(timeout=0.2))
        except queue.Empty:
            pass
    # --port 0 / --api-port 0: the daemon bound free ports and says which.
    address = next(x for x in seen if "engine core 0/2 listening on" in x).split(" listening on ")[1].split()[0]
    base_url = next(x for x in seen if "OpenAI API on" in x).split(" OpenAI API on ")[1].split()[0]
    port = int(address.rsplit(":", 1)[1])
    yield {"address": address, "port": port, "base_url": base_url, "lines": seen, "log": log_path}
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def core_steps(port: int) -> list[int]:
    """Each core's step counter, asked directly (a plain single-core attach to each rank)."""
    steps = []
    for addr in dp_core_addresses(f"tcp://127.0.0.1:{port}", 2):
        c = SyncMPClient(addresses=CoreAddresses.from_base(addr), client_name="stats-probe")
        try:
            steps.append(int(c.call_utility("get_stats")["step_counter"]))
        finally:
            c.shutdown()
    return steps


def test_dp_serve_prints_one_listening_line_per_core(dp_daemon):
    port = dp_daemon["port"]
    text = "\n".join(dp_daemon["lines"])
    assert f"vllm-lite engine core 0/2 listening on tcp://127.0.0.1:{port} " in text
    assert f"vllm-lite engine core 1/2 listening on tcp://127.0.0.1:{port + 2} " in text


def test_python_frontend_spreads_requests_over_both_cores_with_unchanged_outputs(dp_daemon, reference):
    before = core_steps(dp_daemon["port"])
    llm = LLM(engine_address=dp_daemon["address"], data_parallel_size=2)
    try:
        client = llm.llm_engine.engine_core
        assert client.model_facts["data_parallel_size"] == 2
        outs = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [reference(p, 24)[0] for p in PROMPTS]
        routed = client.router.routed
        assert sum(routed) == len(PROMPTS) and min(routed) >= 2, routed
    finally:
        llm.shutdown()
    after = core_steps(dp_daemon["port"])
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both cores did work


def test_follow_ups_with_a_shared_prefix_stick_to_the_core_that_cached_it(dp_daemon, reference):
    llm = LLM(engine_address=dp_daemon["address"], data_parallel_size=2)
    try:
        firsts = llm.generate([p + " one" for p in PREFIXES], greedy(2), use_tqdm=False)
        assert min(llm.llm_engine.engine_core.router.routed) >= 1  # the prefixes went to both cores
        follow = llm.generate([p + " two" for p in PREFIXES], greedy(2), use_tqdm=False)
        for first, second, p in zip(firsts, follow, PREFIXES):
            assert second.num_cached_tokens >= 32, (p, second.num_cached_tokens)  # only that core has them
            assert list(second.outputs[0].token_ids) == reference(p + " two", 2)[0]
            assert list(first.outputs[0].token_ids) == reference(p + " one", 2)[0]
    finally:
        llm.shutdown()


def test_http_frontend_spreads_over_both_cores_with_unchanged_outputs(dp_daemon, reference):
    before = core_steps(dp_daemon["port"])

    def complete(prompt: str) -> str:
        r = httpx.post(
            dp_daemon["base_url"] + "/v1/completions",
            timeout=60.0,
            json={"prompt": prompt, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    assert texts == [reference(p, 24)[1] for p in PROMPTS]
    after = core_steps(dp_daemon["port"])
    assert all(a > b for a, b in zip(after, before)), (before, after)
    health = httpx.get(dp_daemon["base_url"] + "/health", timeout=10.0)
    assert health.status_code == 200
