"""The engine-core process's host work per decode step at large batch, part by part, model-free (issue #14).

A real `EngineCoreProc` (busy loop, client registry, ZMQ sockets and their output thread) over a real
`EngineCore` and `Scheduler`, whose executor is a stand-in that returns one token per sampling request at once
(no model): what is left is the core's own Python, the same on CUDA. A frontend in a child process attaches,
sends `--batch` requests of random 128-512 token prompts in one ADD_BATCH and reads the outputs. Every busy-loop
iteration is timed (from one `_process_input` call to the next), and inside it: reading input, housekeeping,
`schedule`, the executor (`execute_model`, `get_output`: the stand-in's, not the core's), `update_from_output`,
the stats logger, routing the outputs (`_route_outputs`, with the hand-off to the output thread); on the output
thread the encoding and the ZMQ send (it holds the GIL while it encodes). Only steady decode iterations count
(the step updated and the step launched both ran `--batch` one-token requests). Prints one JSON line:
medians per part, in us a step.

`--gpu-us T`: the stand-in's output is ready T us after its launch (`get_output` sleeps until then, releasing the
GIL as a CUDA event wait does), to see the loop with a device step to hide under; then `idle_us` is how much
longer than T an iteration took. `--cprofile N`: also print the top N functions by own time (a second run).

    python benchmarks/core_step.py [--batch 256] [--steps 300] [--sync] [--gpu-us 0] [--reverse] [--kv-parts]
        [--cprofile 25]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from vllm_lite.testing.baselines import bench_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PARTS = ("input", "housekeeping", "schedule", "execute", "get_output", "update", "stats", "route", "send")
# Inside schedule / update: the KV cache manager's calls (new blocks; prefix-cache registration of full blocks).
SUBPARTS = ("kv_allocate", "kv_cache_blocks", "core_step")


def _frontend(addr_in: str, addr_out: str, batch: int, max_tokens: int, seed: int) -> None:
    """The child: HELLO, one ADD_BATCH, read outputs until every request finished, GOODBYE."""
    import zmq

    from vllm_lite.core.messages import EngineCoreOutputType, EngineCoreRequestBatch, EngineCoreRequestType
    from vllm_lite.endpoints import CoreAddresses
    from vllm_lite.sampling_params import SamplingParams
    from vllm_lite.testing.fake_core import RawFrontend, request

    fe = RawFrontend(zmq.Context(), CoreAddresses(addr_in, addr_out))
    assert fe.hello().accepted
    rng = random.Random(seed)
    reqs = []
    for i in range(batch):
        r = request(f"r{i}", [rng.randrange(10, 900) for _ in range(rng.randint(128, 512))], max_tokens)
        r.sampling_params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        r.eos_token_id = 2
        reqs.append(r)
    fe.send(EngineCoreRequestType.ADD_BATCH, EngineCoreRequestBatch(reqs))
    pending = {r.request_id for r in reqs}
    while pending:
        kind, outs = fe.recv(timeout_s=60)
        if kind is EngineCoreOutputType.OUTPUTS:
            for o in outs.outputs:
                if o.finished:
                    pending.discard(o.request_id)
    fe.inp.send_multipart([EngineCoreRequestType.GOODBYE.value])
    time.sleep(0.2)


class _Handle:
    def __init__(self, output: Any, ready_at: float) -> None:
        self.output = output
        self.ready_at = ready_at

    def get_output(self) -> Any:
        if self.ready_at:
            left = self.ready_at - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return self.output


class StandInExecutor:
    """One token (7) per request whose known tokens are all computed after the step; no model."""

    gpu_s = 0.0
    reverse = False

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.left: dict[str, int] = {}  # request -> prompt tokens still to compute

    def determine_num_blocks(self) -> tuple[int, int]:
        cc = self.vllm_config.cache_config
        return cc.num_gpu_blocks, 0

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute_model(self, so: Any, non_block: bool = False) -> Any:
        from vllm_lite.worker.step import ModelRunnerOutput

        for rid in so.finished_req_ids:
            self.left.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.left[nr.req_id] = len(nr.prompt_token_ids) + len(nr.output_token_ids) - nr.num_computed_tokens
        ids = list(so.num_scheduled_tokens)
        if self.reverse:
            ids.reverse()
        left = self.left
        sampled = []
        for rid in ids:
            n = left[rid] - so.num_scheduled_tokens[rid]
            if n > 0:
                left[rid] = n
                sampled.append([])
            else:
                left[rid] = 0
                sampled.append([7])
        out = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, None)
        if not non_block:
            return out
        return _Handle(out, time.perf_counter() + self.gpu_s if self.gpu_s else 0.0)

    def shutdown(self) -> None:
        pass


def core_config(make_config: Any, args: argparse.Namespace) -> Any:
    """The measured core's config (make_config from this tree's or a baseline's vllm_lite.testing): KV room for
    the whole run at args.batch, the step budget and async setting the run asks for."""
    cfg = make_config(
        num_gpu_blocks=args.batch * (512 + args.steps + 40 + 32) // 16 + 64,
        block_size=16,
        max_num_batched_tokens=8192,
        max_num_seqs=args.batch,
        max_model_len=4096,
    )
    cfg.scheduler_config.async_scheduling = not args.sync
    cfg.device_config.num_threads = 1  # as on CUDA: no adaptive CPU thread policy around the steps
    return cfg


def run(args: argparse.Namespace, profile: Optional[Any] = None) -> dict:
    from vllm_lite.core import core_sockets
    from vllm_lite.core.engine_core import EngineCore
    from vllm_lite.core.engine_core_proc import CoreProcOptions, EngineCoreProc
    from vllm_lite.endpoints import CoreAddresses
    from vllm_lite.testing.scheduler_config import make_config

    cfg = core_config(make_config, args)
    StandInExecutor.gpu_s = args.gpu_us * 1e-6
    StandInExecutor.reverse = args.reverse

    class Proc(EngineCoreProc):
        def _make_engine_core(self, vllm_config: Any) -> Any:
            return EngineCore(vllm_config, StandInExecutor)

    tmp = tempfile.mkdtemp(prefix="core-step-")
    addresses = CoreAddresses(f"ipc://{tmp}/in.sock", f"ipc://{tmp}/out.sock")
    proc = Proc(cfg, addresses, CoreProcOptions(heartbeat_timeout_s=None))
    core = proc.engine_core
    sched = core.scheduler
    clock = time.perf_counter
    cur: dict[str, float] = dict.fromkeys(PARTS + SUBPARTS, 0.0)
    rows: list[dict[str, float]] = []
    flags = {"launched": 0, "updated": 0}
    last = [0.0]

    def timed(obj: Any, name: str, part: str, hook: Optional[Callable[[Any, tuple], None]] = None) -> None:
        fn = getattr(obj, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            r = fn(*a, **kw)
            cur[part] += clock() - t0
            if hook is not None:
                hook(r, a)
            return r

        setattr(obj, name, wrapper)

    def on_schedule(so: Any, a: tuple) -> None:
        flags["launched"] = len(so.num_scheduled_tokens) if so.total_num_scheduled_tokens == args.batch else 0

    def on_update(r: Any, a: tuple) -> None:
        so = a[0]
        flags["updated"] = len(so.num_scheduled_tokens) if so.total_num_scheduled_tokens == args.batch else 0

    enc_times: list[float] = []
    encode = core_sockets._encode

    def timed_encode(*a: Any) -> Any:
        t0 = clock()
        r = encode(*a)
        enc_times.append(clock() - t0)
        return r

    core_sockets._encode = timed_encode
    process_input = proc._process_input

    def iteration_start(block: bool) -> None:
        now = clock()
        if last[0]:
            row = dict(cur)
            row["total"] = now - last[0]
            row["decode"] = float(flags["launched"] == args.batch and flags["updated"] == args.batch)
            rows.append(row)
        for k in cur:
            cur[k] = 0.0
        flags["launched"] = flags["updated"] = 0
        last[0] = clock()
        t0 = clock()
        process_input(block)
        cur["input"] += clock() - t0
        if not core.has_unfinished_requests() and len([r for r in rows if r["decode"]]) >= args.steps:
            proc.request_shutdown()

    proc._process_input = iteration_start  # type: ignore[method-assign]
    timed(proc, "_housekeeping", "housekeeping")
    timed(sched, "schedule", "schedule", on_schedule)
    timed(sched, "update_from_output", "update", on_update)
    timed(core.executor, "execute_model", "execute")
    timed(core._stats_log, "record", "stats")
    timed(proc, "_route_outputs", "route")
    timed(proc.sockets, "send", "send")
    timed(core, "step", "core_step")
    if args.kv_parts:  # 32 more timed calls a step at batch 256 (block_size 16): they inflate schedule and update
        timed(sched.kv_cache_manager, "allocate_slots", "kv_allocate")
        timed(sched.kv_cache_manager, "cache_blocks", "kv_cache_blocks")
    if not args.sync:
        # The handle's get_output, through the launched step's handle: wrap the class method.
        orig_get = _Handle.get_output

        def get_output(self: _Handle) -> Any:
            t0 = clock()
            r = orig_get(self)
            cur["get_output"] += clock() - t0
            return r

        _Handle.get_output = get_output  # type: ignore[method-assign]
    child = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--frontend",
            addresses.input,
            addresses.output,
            str(args.batch),
            str(args.steps + 40),
            str(args.seed),
        ]
    )
    try:
        if profile is not None:
            profile.enable()
        code = proc.run_busy_loop()
        if profile is not None:
            profile.disable()
    finally:
        child.wait(30)
        core_sockets._encode = encode
        if not args.sync:
            _Handle.get_output = orig_get  # type: ignore[method-assign]
    assert code == 0
    steady = [r for r in rows if r["decode"]][10:]  # past the first decode steps
    if not steady:
        raise SystemExit("no steady decode steps measured")
    big = sorted(enc_times)[-len(steady) :]  # the step outputs' messages (the rest: tiny replies)
    out: dict[str, Any] = {"steps": len(steady)}
    for k in (*PARTS, *SUBPARTS, "total"):
        out[k] = round(1e6 * statistics.median(r[k] for r in steady), 1)
    core_parts = ("input", "housekeeping", "schedule", "update", "stats", "route")
    other = [r["total"] - sum(r[k] for k in (*core_parts, "execute", "get_output")) for r in steady]
    out["loop_other"] = round(1e6 * statistics.median(other), 1)
    # EngineCore.step's own work (the batch queue, must_sync, ...): the step less what it calls.
    own = [r["core_step"] - sum(r[k] for k in ("schedule", "execute", "get_output", "update", "stats")) for r in steady]
    out["core_step_own"] = round(1e6 * statistics.median(own), 1)
    out["core_us"] = round(
        1e6 * statistics.median(r["total"] - r["execute"] - r["get_output"] for r in steady), 1
    )  # the iteration without the stand-in executor's own work
    out["encode_thread"] = round(1e6 * statistics.median(big), 1)
    if args.gpu_us:
        out["idle_us"] = round(1e6 * statistics.median(r["total"] for r in steady) - args.gpu_us, 1)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--frontend":
        a = sys.argv[2:]
        _frontend(a[0], a[1], int(a[2]), int(a[3]), int(a[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    ap.add_argument("--gpu-us", type=float, default=0.0, help="the stand-in step's device time")
    ap.add_argument("--reverse", action="store_true", help="the runner's rows in the reverse of the step's order")
    ap.add_argument("--kv-parts", action="store_true", help="also time the KV cache manager's calls")
    ap.add_argument("--cprofile", type=int, default=0, help="then the top N functions by own time")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    runs = [run(args) for _ in range(args.reps)]
    result: dict[str, Any] = {"benchmark": "core_step", "batch": args.batch, "async": not args.sync}
    if args.gpu_us:
        result["gpu_us"] = args.gpu_us
    result.update({k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]})
    result["load"] = round(os.getloadavg()[0], 2)
    print(bench_json(result))
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        run(args, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
