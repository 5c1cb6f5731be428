"""What tensor parallelism costs per step on a tiny model: TP=2 (worker processes, gloo) against TP=1.

* broadcast_us: one execute_model round trip with an empty SchedulerOutput --
  the executor's send to every rank plus rank 0's reply, no model work.
* step_us_tp1 / step_us_tp2: mean engine-core decode step (batch of --batch
  requests) on the same tiny checkpoint, so the difference is the broadcast
  plus the collectives (2 all-reduces per layer, embedding all-reduce,
  logits all-gather, sampled-token broadcast).
Prints one JSON line.

    python benchmarks/tp_overhead.py [--arch llama] [--batch 8] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from vllm_lite.testing.baselines import bench_json


def _core(path: str, tp: int):
    from vllm_lite.core.engine_core import EngineCore
    from vllm_lite.engine_args import EngineArgs

    args = EngineArgs(
        model=path,
        dtype="float32",
        tensor_parallel_size=tp,
        max_model_len=512,
        kv_cache_memory_bytes=1 << 25,
        max_num_seqs=64,
    )
    return EngineCore(args.create_engine_config())


def _decode_step_us(core, batch: int, steps: int) -> float:
    from vllm_lite.core.messages import EngineCoreRequest
    from vllm_lite.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineCoreRequest(f"r{i}", [1, 5 + i, 9, 12, 40 + i], params, None, time.time()))
    for _ in range(5):  # prefill + warm-up
        core.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    return (time.perf_counter() - t0) / steps * 1e6


def _broadcast_us(executor, n: int) -> float:
    from vllm_lite.worker.step import SchedulerOutput

    empty = SchedulerOutput.empty()
    for _ in range(20):
        executor.execute_model(empty)
    t0 = time.perf_counter()
    for _ in range(n):
        executor.execute_model(empty)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--round-trips", type=int, default=500)
    args = p.parse_args()
    torch.set_num_threads(1)
    from vllm_lite.testing.checkpoints import get_checkpoint

    path = get_checkpoint(args.arch)
    result: dict[str, object] = {
        "bench": "tp_overhead",
        "arch": args.arch,
        "size": "tiny",
        "batch": args.batch,
        "steps": args.steps,
        "backend": "gloo",
        "cpus": len(os.sched_getaffinity(0)),
    }
    core = _core(path, 1)
    result["step_us_tp1"] = round(_decode_step_us(core, args.batch, args.steps), 1)
    core.shutdown()
    core = _core(path, 2)
    try:
        result["broadcast_us"] = round(_broadcast_us(core.executor, args.round_trips), 1)
        result["step_us_tp2"] = round(_decode_step_us(core, args.batch, args.steps), 1)
    finally:
        core.shutdown()
    result["tp2_overhead_us"] = round(result["step_us_tp2"] - result["step_us_tp1"], 1)  # type: ignore[operator]
    print(bench_json(result))


if __name__ == "__main__":
    main()
