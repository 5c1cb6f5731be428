"""Multi-node tensor parallelism simulated on one machine: two "nodes" on loopback.

Node 1 is a separate `vllm-lite worker` process tree started with the
multi-node flags; node 0 is the engine (LLM) in this test, started with the
same flags. They meet only through torch.distributed's TCP rendezvous.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.processes import rank_children

PROMPTS = ["The quick brown fox jumps over", "def fibonacci(n):\n    return"]
# CPU ranks (gloo): both loopback "nodes" would put their rank on cuda:0 of this one host.
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24, max_num_seqs=8, device="cpu")
# Generous: a loaded 2-core machine only makes these tests slower, never wrong.
DEADLINE_S = 120.0
# Node 0's rendezvous admits only nodes that prove the engine's auth token.
TOKEN = "multinode-test-token"


def _rendezvous_socket() -> socket.socket:
    """A socket listening on a free loopback port, bound once: node 0's rendezvous store takes it over
    (``ParallelConfig.master_listen_fd``), so no other process can take the port in between."""
    return socket.create_server(("127.0.0.1", 0))


def _node0_engine(rendezvous: socket.socket, **kw: Any) -> Any:
    """Node 0: an LLMEngine (private core process) whose rendezvous store listens on ``rendezvous``."""
    from vllm_lite.client.llm_engine import LLMEngine
    from vllm_lite.engine_args import EngineArgs

    config = EngineArgs(
        tensor_parallel_size=2,
        nnodes=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=rendezvous.getsockname()[1],
        **kw,
        **ENGINE_KW,
    ).create_engine_config()
    config.parallel_config.master_listen_fd = rendezvous.fileno()
    config.parallel_config.rendezvous_token = TOKEN
    return LLMEngine(config)


def _worker_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "vllm_lite.entrypoints.cli", "worker", *flags]


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def _engine_greedy(engine: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(PROMPTS))]


def test_two_loopback_nodes_give_the_same_greedy_outputs_as_one_device():
    path = get_checkpoint("qwen2")
    with LLM(path, multiprocess=False, **ENGINE_KW) as ref:
        want = _greedy(ref)
    rendezvous = _rendezvous_socket()
    port = rendezvous.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    node1 = subprocess.Popen(
        _worker_cmd(
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--tensor-parallel-size",
            "2",
            "--connect-timeout",
            "120",
            "--auth-token",
            TOKEN,
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        engine = _node0_engine(rendezvous, model=path)
        try:
            got = _engine_greedy(engine)
        finally:
            engine.shutdown()
        # The engine is gone: node 1's ranks notice and its worker command exits cleanly.
        out, _ = node1.communicate(timeout=DEADLINE_S)
    finally:
        rendezvous.close()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert got == want
    assert node1.returncode == 0, out
    assert "runs ranks 1..1 of 2" in out


def test_worker_node_rejects_bad_multinode_flags_with_a_clear_error():
    res = subprocess.run(
        _worker_cmd("--nnodes", "2", "--node-rank", "0", "--master-port", "29500"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "--node-rank must be in [1, 2)" in res.stderr


def test_engine_refuses_a_nonzero_node_rank_and_a_missing_master_port():
    path = get_checkpoint("qwen2")
    with pytest.raises(ValueError, match="node_rank=1: the engine runs on node 0"):
        LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29500, **ENGINE_KW)
    with pytest.raises(ValueError, match="master_port must be set"):
        LLM(path, tensor_parallel_size=2, nnodes=2, **ENGINE_KW)
    with pytest.raises(ValueError, match="multiple of nnodes=2"):
        LLM(path, tensor_parallel_size=3, nnodes=2, master_port=29500, **ENGINE_KW)


def test_killing_the_remote_nodes_rank_gives_engine_dead_error():
    from vllm_lite.client.exceptions import EngineDeadError

    rendezvous = _rendezvous_socket()
    node1 = subprocess.Popen(
        _worker_cmd(
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            str(rendezvous.getsockname()[1]),
            "--connect-timeout",
            "120",
            "--auth-token",
            TOKEN,
        ),
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    engine = None
    try:
        engine = _node0_engine(rendezvous, model=get_checkpoint("qwen2"))
        engine.add_request("r0", "Once upon a time", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        produced = 0
        while produced < 3:
            produced += sum(len(o.outputs[0].token_ids) > 0 for o in engine.step())
        remote_ranks = rank_children(node1.pid)
        assert len(remote_ranks) == 1
        os.kill(remote_ranks[0], signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE_S  # a hang fails the test; how fast is not asserted here
        with pytest.raises(EngineDeadError):
            while time.monotonic() < deadline:
                engine.step()
        assert node1.wait(timeout=DEADLINE_S) == 1  # the worker command reports its rank's failure
    finally:
        rendezvous.close()
        if engine is not None:
            engine.shutdown()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
