"""Async scheduling (issue #14) on a GPU, in one short run: the runner's async path against its sync path.

  python scripts/async_gpu_check.py                      # CUDA, llama-1b shape (random bf16 weights), < 90 s
  python scripts/async_gpu_check.py --device cpu --smoke  # the same code on CPU, tiny float32 llama (tests)

(a) no host sync while launching an async decode step: torch.cuda.set_sync_debug_mode("error") around
    execute_model(so, non_block=True) (the previous step still unread) for a greedy and a seeded-random batch, with
    CUDA graphs and eager; (b) greedy tokens identical sync vs async, with and without CUDA graphs (one batch,
    ignore_eos); (c) out tok/s at --batch and ms/token at batch 1, sync vs async (graphs on), same process, same
    card. Steps are driven by vllm_lite.testing.stand_in_core (prefill, then one token a step; async keeps two steps
    in flight as the engine core does). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_lite.engine_args import EngineArgs  # noqa: E402
from vllm_lite.sampling_params import SamplingParams  # noqa: E402
from vllm_lite.testing.stand_in_core import StandInCore  # noqa: E402

BLOCK_SIZE = 16
# Run the sync check off CUDA too (the tests, with torch.cuda.set_sync_debug_mode stood in).
CHECK_OFF_CUDA = False


def _build_runner(model: str, device: torch.device, dtype: str, async_: bool, batch: int, max_len: int):
    from vllm_lite.worker.model_runner import GPUModelRunner

    blocks_per_req = -(-max_len // BLOCK_SIZE)
    config = EngineArgs(
        model=model,
        device=device.type,
        dtype=dtype,
        max_model_len=blocks_per_req * BLOCK_SIZE,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * max_len),
        block_size=BLOCK_SIZE,
        async_scheduling=async_,
    ).create_engine_config()
    runner = GPUModelRunner(config, device)
    runner.initialize_kv_cache(1 + batch * blocks_per_req, 0)
    runner.capture_cuda_graphs()  # CUDA only (a no-op on CPU)
    return runner, blocks_per_req


def _stand_in_graphs(runner) -> None:
    """CPU: the replay path with graphs that run the forward eagerly over the persistent buffers (as the tests)."""
    from vllm_lite.testing.device_ops import install_stand_in_graphs

    install_stand_in_graphs(runner, [(b, 1) for b in (1, 2, 4, 8, 16) if b <= runner.max_num_reqs])


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(prompt_len)] for i in range(batch)]


def _reset(runner) -> None:
    """Drop every request from the runner's batch (between runs on the same runner)."""
    for rid in [r for r in runner.input_batch.req_ids if r is not None]:
        runner.input_batch.remove_request(rid)


def _drive(
    runner,
    blocks_per_req: int,
    async_: bool,
    prompts: list[list[int]],
    params: list[SamplingParams],
    graphs: bool,
    sync_check_at: Optional[int] = None,
    sync_mode: str = "error",
) -> dict[str, Any]:
    """Prefill then decode every request to max_tokens; returns tokens, decode seconds and the sync-check verdict."""
    saved = runner.cuda_graphs
    if not graphs:
        runner.cuda_graphs = None
    _reset(runner)
    core = StandInCore(runner, async_, record_inputs=False, blocks_per_req=blocks_per_req)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add(i, p, sp)
    cuda = runner.device.type == "cuda"
    verdict: Any = None
    try:
        core.step()  # prefill
        if cuda:
            torch.cuda.synchronize(runner.device)
        t0 = time.perf_counter()
        steps = 0
        while any(r.status == "running" for r in core.reqs.values()) or core.in_flight:
            if not any(len(r.out) + r.ph < r.params.max_tokens for r in core.reqs.values()):
                core.drain()
                break
            if (cuda or CHECK_OFF_CUDA) and sync_check_at is not None and steps == sync_check_at:
                verdict = _checked_step(core, sync_mode)
            else:
                core.step()
            steps += 1
        core.drain()
        if cuda:
            torch.cuda.synchronize(runner.device)
        seconds = time.perf_counter() - t0
    except _SyncFound:
        for handle in core.in_flight:  # read what was launched before the failed launch (frees its ring slot)
            handle.get_output()
        runner._prev = None
        raise
    finally:
        runner.cuda_graphs = saved
    return {
        "tokens": [core.reqs[f"r{i}"].out for i in range(len(prompts))],
        "decode_s": seconds,
        "decode_steps": steps,
        "sync_check": verdict,
    }


class _SyncFound(Exception):
    pass


def _checked_step(core: StandInCore, mode: str) -> Any:
    """One async launch under set_sync_debug_mode(mode): 'ok', or (mode 'error') _SyncFound with the first sync's
    message, or (mode 'warn') the list of every sync warning's source line and message."""
    import warnings

    so = core.schedule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            handle = core.runner.execute_model(so, non_block=True) if core.async_ else core.runner.execute_model(so)
        except RuntimeError as e:
            raise _SyncFound(str(e).splitlines()[0][:300]) from None
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch's one-time notice ("Synchronization debug mode is a prototype feature ...") names no sync: the first
    # checked launch of a run caught it (H200, 2026-11-27: greedy_eager listed only that notice).
    syncs = [
        f"{w.filename}:{w.lineno}: {str(w.message)[:160]}"
        for w in caught
        if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)
    ]
    if not core.async_:  # the control: a synchronous step reads its tokens back
        core.update(handle)
        return syncs
    core.in_flight.append(handle)
    if len(core.in_flight) == 2:
        core.update(core.in_flight.popleft().get_output())
    return "ok" if not syncs else syncs


def _checked_drive(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """An async drive with the sync check at its 3rd decode launch: under mode 'error' (the verdict); when that
    raises, the drive again under 'warn' to list every sync site (and still compare its tokens)."""
    try:
        return _drive(*args, sync_check_at=3, sync_mode="error", **kwargs)
    except _SyncFound as e:
        out = _drive(*args, sync_check_at=3, sync_mode="warn", **kwargs)
        out["sync_check"] = {"error": str(e), "all_syncs": out["sync_check"]}
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny float32 llama, few steps (CPU tests)")
    ap.add_argument("--shape", default="llama-1b", help="vllm_lite.testing.gpu_bench shape (random weights)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    scratch = tempfile.mkdtemp(prefix="async-gpu-check-")
    if args.smoke:
        from vllm_lite.testing.checkpoints import get_checkpoint

        model, dtype, batch, prompt_len, max_tokens = get_checkpoint("llama"), "float32", 4, 8, 6
        build: dict[str, Any] = {}
    else:
        from vllm_lite.testing.gpu_bench import build_random_checkpoint

        model, dtype = os.path.join(scratch, args.shape), args.dtype
        batch, prompt_len, max_tokens = args.batch, args.prompt_len, args.max_tokens
        build = build_random_checkpoint(args.shape, model, device, getattr(torch, dtype))
    max_len = prompt_len + max_tokens + 1

    runners = {}
    for async_ in (False, True):
        runner, bpr = _build_runner(model, device, dtype, async_, batch, max_len)
        if device.type != "cuda":
            _stand_in_graphs(runner)
        runners[async_] = runner
    vocab = runners[False].vocab_size
    prompts = _prompts(batch, prompt_len, vocab)
    greedy = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * batch
    seeded = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=max_tokens, ignore_eos=True) for i in range(batch)
    ]

    # (b) token identity, and (a) the sync check inside the async runs (3rd decode launch: both ring slots warm).
    res: dict[str, Any] = {
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    identical, sync_free = {}, {}
    for graphs in (False, True):
        key = "graphs" if graphs else "eager"
        s = _drive(runners[False], bpr, False, prompts, greedy, graphs)
        a = _checked_drive(runners[True], bpr, True, prompts, greedy, graphs)
        identical[key] = s["tokens"] == a["tokens"]
        sync_free[f"greedy_{key}"] = a["sync_check"]
        sr = _drive(runners[False], bpr, False, prompts, seeded, graphs)
        ar = _checked_drive(runners[True], bpr, True, prompts, seeded, graphs)
        identical[f"seeded_{key}"] = sr["tokens"] == ar["tokens"]
        sync_free[f"seeded_{key}"] = ar["sync_check"]
    res["tokens_identical"] = all(identical.values())
    res["tokens_identical_detail"] = identical
    if device.type == "cuda":
        # The control: the debug mode does see the synchronous step's read of its tokens (so 'ok' above means none).
        control = _drive(runners[False], bpr, False, prompts, greedy, True, sync_check_at=3, sync_mode="warn")
        sync_free["control_sync_step_syncs"] = len(control["sync_check"] or [])
    res["sync_free_launch"] = sync_free if device.type == "cuda" else "n/a off CUDA"

    # (c) speed, graphs on: out tok/s at `batch`, ms/token at batch 1 (a warm-up run each first).
    speed: dict[str, Any] = {}
    for name, async_ in (("sync", False), ("async", True)):
        r = runners[async_]
        _drive(r, bpr, async_, prompts, greedy, True)
        run = _drive(r, bpr, async_, prompts, greedy, True)
        speed[f"{name}_out_tok_s"] = round(batch * run["decode_steps"] / run["decode_s"], 1)
        _drive(r, bpr, async_, prompts[:1], greedy[:1], True)
        one = _drive(r, bpr, async_, prompts[:1], greedy[:1], True)
        speed[f"{name}_b1_ms_per_token"] = round(1e3 * one["decode_s"] / one["decode_steps"], 3)
    res.update(speed)
    res.update(
        shape="tiny-llama" if args.smoke else args.shape,
        dtype=dtype,
        batch=batch,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        checkpoint_build_s=build.get("build_s"),
        wall_s=round(time.perf_counter() - t_start, 1),
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
