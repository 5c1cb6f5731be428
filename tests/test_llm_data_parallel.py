"""`data_parallel_size` for a private engine: LLM / LLMEngine / AsyncLLM start D cores and route over them.

Greedy outputs must not depend on which core served a prompt, so D=2 gives D=1's tokens;
both cores must have done work, each in a process of its own.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.client.async_llm import AsyncLLM
from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint

PROMPTS = ["The for statement", "Hello world", "def f(x): return", "Exceptions are raised", "while True:", "import sys"]
ENGINE_KW = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8}


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def live_children(pid: int) -> set[int]:
    """Direct children of `pid` that are running (not zombies), from /proc."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry))
    return out


@pytest.fixture(scope="module")
def ckpt() -> str:
    return get_checkpoint("llama")


@pytest.fixture(scope="module")
def dp1_tokens(ckpt: str) -> list[list[int]]:
    # One core in this process: the same tokens as a core process (test_inproc_vs_multiprocess), one start fewer.
    with LLM(ckpt, multiprocess=False, **ENGINE_KW) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def test_llm_with_two_data_parallel_cores_gives_the_single_core_greedy_tokens(ckpt, dp1_tokens):
    before = live_children(os.getpid())
    with LLM(ckpt, data_parallel_size=2, **ENGINE_KW) as llm:
        started = live_children(os.getpid()) - before
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        stats = llm.llm_engine.call_utility("get_stats")
    assert [list(o.outputs[0].token_ids) for o in outs] == dp1_tokens
    per_core = stats["per_core"]
    assert len(per_core) == 2 and all(core["step_counter"] > 0 for core in per_core), per_core
    assert len(started) >= 2, f"expected two engine core processes, new children: {started}"


def test_each_rank_gets_a_share_of_the_cpu_threads(ckpt):
    ncpu = len(os.sched_getaffinity(0))
    configs = EngineArgs(model=ckpt, data_parallel_size=2, **ENGINE_KW).create_dp_engine_configs()
    assert len(configs) == 2
    assert [c.device_config.num_threads for c in configs] == [max(1, ncpu // 2)] * 2
    assert all(c.parallel_config.data_parallel_size == 2 for c in configs)
    pinned = EngineArgs(model=ckpt, data_parallel_size=2, num_threads=3, master_port=29500, **ENGINE_KW)
    configs = pinned.create_dp_engine_configs()
    assert [c.device_config.num_threads for c in configs] == [3, 3]
    assert [c.parallel_config.master_port for c in configs] == [29500, 29510]


def test_data_parallel_in_this_process_is_refused_clearly(ckpt):
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLM(ckpt, data_parallel_size=2, multiprocess=False, **ENGINE_KW)


@pytest.mark.parametrize("dp", [0, -1])
def test_data_parallel_size_below_one_is_a_value_error(ckpt, dp):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(ckpt, data_parallel_size=dp, **ENGINE_KW)


def test_async_llm_with_two_data_parallel_cores_gives_the_single_core_greedy_tokens(ckpt, dp1_tokens):
    async def run() -> list[list[int]]:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=ckpt, data_parallel_size=2, **ENGINE_KW))
        try:
            assert len(engine.engine_core.clients) == 2

            async def one(i: int) -> list[int]:
                last = None
                async for out in engine.generate(PROMPTS[i], greedy(), request_id=f"r{i}"):
                    last = out
                return list(last.outputs[0].token_ids)

            return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == dp1_tokens
