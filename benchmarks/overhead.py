"""What the process boundary costs: wire encode/decode, and a step through the socket vs in-process.

Uses a zero-cost core (no model) so that every microsecond measured is transport:
serialization, ZMQ, the core's threads and queues, the client's receive thread.
Prints one JSON line.

    python benchmarks/overhead.py [--batch 64] [--steps 300] [--logprobs 5] [--step-ms 2]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from vllm_lite.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.serialization import MsgpackDecoder, MsgpackEncoder
from vllm_lite.testing.baselines import bench_json
from vllm_lite.testing.null_core import NullInprocClient, NullSyncMPClient, null_config
from vllm_lite.worker.step import LogprobsTensors


def batch_outputs(batch: int, logprobs: int) -> EngineCoreOutputs:
    """One decode step's outputs for `batch` requests, logprobs batched as the runner makes them."""
    outs = []
    for i in range(batch):
        o = EngineCoreOutput(f"req-{i}", [1234])
        if logprobs:
            o.new_logprobs = LogprobsTensors(
                torch.randint(0, 32000, (1, logprobs + 1)),
                torch.randn(1, logprobs + 1),
                torch.ones(1, dtype=torch.int64),
            )
        outs.append(o)
    return EngineCoreOutputs(outputs=outs, scheduler_stats=SchedulerStats(num_running_reqs=batch))


def time_codec(batch: int, logprobs: int, iters: int = 300) -> dict[str, float]:
    msg = batch_outputs(batch, logprobs)
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    frames = enc.encode(msg)
    t0 = time.perf_counter()
    for _ in range(iters):
        frames = enc.encode(msg)
    t1 = time.perf_counter()
    raw = [bytes(f) for f in frames]
    for _ in range(iters):
        dec.decode(raw)
    t2 = time.perf_counter()
    return {
        "encode_us": 1e6 * (t1 - t0) / iters,
        "decode_us": 1e6 * (t2 - t1) / iters,
        "bytes": sum(len(r) for r in raw),
        "frames": len(raw),
    }


def time_steps(client: Any, batch: int, steps: int) -> float:
    """Mean seconds per get_output() with `batch` running requests (after warm-up)."""
    for i in range(batch):
        client.add_request(EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=None), None, time.time()))
    got = 0
    while got < 20 * batch:  # warm-up; the MP core runs ahead of us, which is the point
        got += len(client.get_output().outputs)
    t0 = time.perf_counter()
    got = 0
    while got < steps * batch:
        got += len(client.get_output().outputs)
    dt = time.perf_counter() - t0
    client.abort_requests([f"r{i}" for i in range(batch)])
    return dt * batch / got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=2.0, help="simulated model time per step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"batch": args.batch, "logprobs": args.logprobs, "step_ms": args.step_ms}
    result["codec"] = {f"batch{b}": time_codec(b, args.logprobs) for b in (1, args.batch)}

    inproc = NullInprocClient(null_config(args.logprobs, args.step_ms))
    result["inproc_step_us"] = 1e6 * time_steps(inproc, args.batch, args.steps)
    inproc.shutdown()

    mp = NullSyncMPClient(null_config(args.logprobs, args.step_ms))
    try:
        mp.call_utility("ping")
        t0 = time.perf_counter()
        for _ in range(200):
            mp.call_utility("ping")
        # Frontend -> core -> frontend on an idle core: the floor of any request's latency.
        result["mp_idle_roundtrip_us"] = 1e6 * (time.perf_counter() - t0) / 200
        # The core runs ahead of the client here, so this is the pipelined cost per step.
        result["mp_step_us"] = 1e6 * time_steps(mp, args.batch, args.steps)
    finally:
        mp.shutdown()
    print(bench_json(result))


if __name__ == "__main__":
    main()
