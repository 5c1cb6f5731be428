"""Host cost of launching a CUDA graph while an earlier launch is still running, and of the stream calls that
async scheduling makes each step. A GPU-lease probe (CUDA only).

    python3 scripts/graph_launch_probe.py

A graph of --kernels small kernels (about the bundled model's decode step) is captured twice (two graph execs
of the same work). Timed on the host, median microseconds per launch:
- idle: each replay after a synchronize (the GPU idle, as in a synchronous engine step);
- same: replay the same exec while its previous launch is still running (async scheduling, one exec per key);
- other: replay one exec while the other one (the same work) is still running.
Then the per-call host cost of torch.cuda.current_stream, torch.cuda.Event(), Event.record, wait_stream and the
torch.cuda.stream context. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=60)
    ap.add_argument("--size", type=int, default=1 << 20, help="elements each kernel touches")
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.randn(a.size, device=dev)
    stream = torch.cuda.Stream()
    execs = []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up outside capture
                y = x
                for _ in range(a.kernels):
                    y = y * 1.0001
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                y = x
                for _ in range(a.kernels):
                    y = y * 1.0001
        execs.append(g)
    torch.cuda.synchronize()

    def timed(first: int | None, second: int) -> float:
        """Median host time of replaying exec `second` just after exec `first` was launched (None: GPU idle)."""
        times = []
        for _ in range(a.iters):
            torch.cuda.synchronize()
            if first is not None:
                execs[first].replay()
            t0 = time.perf_counter()
            execs[second].replay()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return round(1e6 * statistics.median(times), 2)

    t0 = time.perf_counter()
    execs[0].replay()
    torch.cuda.synchronize()
    gpu_us = 1e6 * (time.perf_counter() - t0)
    out = {
        "gpu": torch.cuda.get_device_name(),
        "kernels": a.kernels,
        "graph_gpu_us_approx": round(gpu_us, 1),
        "launch_us_idle": timed(None, 0),
        "launch_us_same_exec_in_flight": timed(0, 0),
        "launch_us_other_exec_in_flight": timed(1, 0),
    }

    def per_call(fn) -> float:
        times = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1e6 * statistics.median(times), 2)

    side = torch.cuda.Stream()
    ev = torch.cuda.Event()
    out["current_stream_us"] = per_call(lambda: torch.cuda.current_stream(dev))
    out["event_new_us"] = per_call(torch.cuda.Event)
    out["event_record_us"] = per_call(lambda: ev.record(side))
    out["wait_stream_us"] = per_call(lambda: side.wait_stream(torch.cuda.current_stream()))

    def ctx() -> None:
        with torch.cuda.stream(side):
            pass

    out["stream_context_us"] = per_call(ctx)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
