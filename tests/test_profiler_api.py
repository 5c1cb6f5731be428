"""vLLM's profiler API: $VLLM_TORCH_PROFILER_DIR, EngineCore.profile(is_start) (the "profile" utility),
LLM / LLMEngine / AsyncLLM start_profile() and stop_profile(), and the server's POST /start_profile and
/stop_profile (served only with the variable set). Each stop writes one Chrome trace from the engine core's
process; misuse gives clear errors and the core keeps serving."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.client.async_llm import AsyncLLM
from vllm_lite.core.engine_core import EngineCore
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.core.profiler import METADATA_KEY, TRACE_SUFFIX
from vllm_lite.engine_args import EngineArgs
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.testing.gpu_bench import read_chrome_trace, trace_busy_facts
from vllm_lite.testing.openai_fake_engine import FakeAsyncLLM
from vllm_lite.testing.paged_fake_executor import PagedFakeExecutor
from vllm_lite.testing.scheduler_config import make_config

ENV = "VLLM_TORCH_PROFILER_DIR"
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LLM_KW = dict(dtype="float32", max_model_len=128, device="cpu", kv_cache_memory_bytes=4 << 20, num_threads=1)


def traces(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{TRACE_SUFFIX}"))


def load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def op_names(trace: dict[str, Any]) -> set[str]:
    return {e.get("name") for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}


# ---------------------------------------------------------------------- the core, model-free
def fake_core() -> EngineCore:
    cfg = make_config()
    cfg.scheduler_config.async_scheduling = True  # steps in flight: profile must drain them
    return EngineCore(cfg, lambda c: PagedFakeExecutor(c, vocab=64))


def add(core: EngineCore, rid: str, max_tokens: int = 8) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, [1, 2, 3], params, None, 0.0))


def run_to_end(core: EngineCore) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for batch in core.step().values():
            for o in batch.outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def test_core_profile_drains_counts_its_steps_and_writes_one_trace(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "traces"))
    core = fake_core()
    add(core, "a", max_tokens=12)
    core.step()
    core.step()
    assert core.batch_queue  # a step in flight
    core.call_utility("profile", [True])
    assert not core.batch_queue  # drained before the profiler started
    counter = core.scheduler.make_stats(reset=False).step_counter
    for _ in range(3):
        core.step()
    steps = core.scheduler.make_stats(reset=False).step_counter - counter
    path = core.call_utility("profile", [False])
    assert not core.batch_queue
    files = traces(tmp_path / "traces")
    assert [str(p) for p in files] == [path]
    meta = load(files[0])[METADATA_KEY]
    assert meta["engine_steps"] == steps > 0 and meta["pid"] == os.getpid()
    assert run_to_end(core)  # serving on
    core.shutdown()


def test_core_profile_misuse_errors_clearly_and_the_core_keeps_serving(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    core = fake_core()
    ref = fake_core()
    add(core, "a")
    add(ref, "a")
    core.step()
    with pytest.raises(ValueError, match=ENV):
        core.call_utility("profile", [True])
    with pytest.raises(ValueError, match=ENV):
        core.call_utility("profile", [False])
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="not running"):
        core.call_utility("profile", [False])
    core.call_utility("profile", [True])
    with pytest.raises(RuntimeError, match="already running"):
        core.call_utility("profile", [True])
    core.call_utility("profile", [False])
    assert len(traces(tmp_path)) == 1
    with pytest.raises(RuntimeError, match="not running"):
        core.call_utility("profile", [False])
    assert run_to_end(core) == run_to_end(ref)  # every token, none lost to the failed calls
    core.shutdown()
    ref.shutdown()


def test_shutdown_stops_a_running_profile_without_writing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    core = fake_core()
    core.call_utility("profile", [True])
    core.shutdown()
    assert not core.profiler.running and traces(tmp_path) == []


# ---------------------------------------------------------------------- LLM: in-process and multiprocess
def check_llm_trace(directory: Path, expect_pid_other_than_ours: bool) -> dict[str, Any]:
    files = traces(directory)
    assert len(files) == 1, files
    trace = load(files[0])
    meta = trace[METADATA_KEY]
    assert meta["engine_steps"] >= PARAMS.max_tokens
    assert (meta["pid"] != os.getpid()) == expect_pid_other_than_ours
    names = op_names(trace)
    assert "aten::embedding" in names, sorted(names)[:40]  # the model's forward ran inside the window
    parsed = read_chrome_trace(str(files[0]))
    assert parsed["device_events"] == [] and parsed["window_us"] > 0 and parsed["engine_steps"] == meta["engine_steps"]
    return trace


def test_llm_in_process_start_stop_profile(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with LLM(model=tiny_checkpoint, multiprocess=False, **LLM_KW) as llm:
        with pytest.raises(ValueError, match=ENV):
            llm.start_profile()
        ref = llm.generate("The for statement", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        monkeypatch.setenv(ENV, str(tmp_path))  # in-process: the core reads the variable at each call
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        out = llm.generate("The for statement", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        llm.stop_profile()
        with pytest.raises(RuntimeError, match="not running"):
            llm.stop_profile()
        assert out == ref
    check_llm_trace(tmp_path, expect_pid_other_than_ours=False)


def test_llm_multiprocess_start_stop_profile_writes_the_core_process_trace(
    tiny_checkpoint, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))  # the private core's environment is a copy of ours at its start
    with LLM(model=tiny_checkpoint, multiprocess=True, **LLM_KW) as llm:
        ref = llm.generate("The for statement", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(RuntimeError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        out = llm.generate("The for statement", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        llm.stop_profile()
        assert out == ref
        assert llm.generate("The for statement", PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref
    check_llm_trace(tmp_path, expect_pid_other_than_ours=True)


def test_llm_multiprocess_without_the_variable_refuses_and_serves_on(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with LLM(model=tiny_checkpoint, multiprocess=True, **LLM_KW) as llm:
        ref = llm.generate("The for statement", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        monkeypatch.setenv(ENV, str(tmp_path))  # too late: the core's environment was copied at its start
        for call in (llm.start_profile, llm.stop_profile):
            with pytest.raises(ValueError, match=ENV):
                call()
        assert llm.generate("The for statement", PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert traces(tmp_path) == []


def test_llm_data_parallel_profiles_every_rank(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))
    kw = dict(LLM_KW, max_num_seqs=8)
    kw.pop("num_threads")
    with LLM(model=tiny_checkpoint, data_parallel_size=2, **kw) as llm:
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        llm.generate(["The for statement", "def main():", "A class", "Exceptions"], PARAMS, use_tqdm=False)
        llm.stop_profile()
    files = traces(tmp_path)
    pids = {load(p)[METADATA_KEY]["pid"] for p in files}
    assert len(files) == 2 and len(pids) == 2 and os.getpid() not in pids  # one trace per rank, by name


# ---------------------------------------------------------------------- AsyncLLM and the HTTP routes
async def call(app: Any, method: str, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_profile_routes_are_not_served_without_the_variable(tiny_checkpoint, monkeypatch, path) -> None:
    monkeypatch.delenv(ENV, raising=False)
    app = build_app(FakeAsyncLLM(tiny_checkpoint), "m")
    assert asyncio.run(call(app, "POST", path)).status_code == 404
    assert path not in {getattr(r, "path", None) for r in app.routes}


def test_async_llm_and_the_http_routes_profile_the_core(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path))

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_checkpoint, **LLM_KW))
        try:
            app = build_app(engine, "m")
            assert {"/start_profile", "/stop_profile"} <= {getattr(r, "path", None) for r in app.routes}
            resp = await call(app, "POST", "/stop_profile")
            assert resp.status_code == 400 and "not running" in resp.json()["error"]["message"]
            assert (await call(app, "POST", "/start_profile")).status_code == 200
            resp = await call(app, "POST", "/start_profile")
            assert resp.status_code == 400 and "already running" in resp.json()["error"]["message"]
            body = {"model": "m", "prompt": "The for statement", "max_tokens": 6, "ignore_eos": True}
            assert (await call(app, "POST", "/v1/completions", json=body)).status_code == 200
            assert (await call(app, "POST", "/stop_profile")).status_code == 200
            assert len(traces(tmp_path)) == 1
            # AsyncLLM's own calls are awaitables, as vLLM's.
            await engine.start_profile()
            async for _ in engine.generate("The for statement", PARAMS, "r2"):
                pass
            await engine.stop_profile()
            assert len(traces(tmp_path)) == 2
        finally:
            engine.shutdown()

    asyncio.run(main())
    for path in traces(tmp_path):
        assert "aten::embedding" in op_names(load(path))


# ---------------------------------------------------------------------- benchmarks/gpu.py's multiprocess figure
def test_gpu_benchmark_multiprocess_busy_worker_on_cpu_writes_and_parses_the_core_trace(tiny_checkpoint, tmp_path):
    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    settings = dict(
        device="cpu",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=None,
        llm_kwargs={"num_threads": 1},
        input_len=[8, 24],
        num_prompts=8,
        vocab=vocab,
        seed=0,
        # The core runs ahead of the frontend (the window counts the core's own steps): with few tokens left a busy
        # host let it finish every request before the profiled window opened (0 steps traced). The requests are
        # aborted after the window, so a long budget costs nothing.
        output_len=960,
        mp_profile_steps=4,
    )
    spec = {"model": tiny_checkpoint, "settings": settings, "enforce_eager": False}
    spec["profiler_dir"] = str(tmp_path / "profiler")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != ENV}  # the worker sets it for its own core
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu.py")
    proc = subprocess.run(
        [sys.executable, script, "--worker", "mp_profile", str(spec_file)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        timeout=600,
    )
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["busy_fraction"] is None and "no GPU" in res["note"]  # CPU: no device figure, said so
    assert res["batch"] == 8 and res["target_engine_steps"] == 4 and res["engine_steps"] >= 4
    assert res["requests_finished_in_window"] == 0 and res["cpu_ops"] > 0 and res["window_ms"] > 0
    # the same window unprofiled before it: its core steps and time a step; no busy figure without a GPU
    assert res["unprofiled_core_steps"] >= 4 and res["unprofiled_window_ms_per_step"] > 0
    assert res["busy_fraction_unprofiled_window"] is None
    trace = tmp_path / "profiler" / res["trace_file"]
    assert "aten::embedding" in op_names(load(trace))
    assert load(trace)[METADATA_KEY]["engine_steps"] == res["engine_steps"]
    assert res["trace_dir"] == str(tmp_path / "profiler") and traces(tmp_path / "profiler") == [trace]


def test_trace_busy_facts_on_a_cuda_trace_worked_by_hand(tmp_path) -> None:
    def x(cat: str, name: str, ts: float, dur: float) -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    # A 100 us window of 2 steps: kernels 0-10 and 5-20 (overlap: 20 us), 50-60, a copy 70-80: 40 us busy.
    events = [
        x("Trace", "PyTorch Profiler (0)", 0, 100),
        x("kernel", "gemm", 0, 10),
        x("kernel", "rmsnorm", 5, 15),
        x("kernel", "gemm", 50, 10),
        x("gpu_memcpy", "Memcpy DtoH", 70, 10),
        x("cuda_runtime", "cudaGraphLaunch", 1, 3),
        x("cpu_op", "aten::embedding", 2, 1),
        {"ph": "M", "name": "process_name", "pid": 1},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, METADATA_KEY: {"engine_steps": 2}}))
    parsed = read_chrome_trace(str(path))
    assert parsed["window_us"] == 100 and parsed["device_span_us"] == 80 and parsed["engine_steps"] == 2
    f = trace_busy_facts(parsed, cuda=True)
    assert f["busy_fraction"] == pytest.approx(0.4) and f["busy_fraction_device_span"] == pytest.approx(0.5)
    assert f["busy_ms_per_step"] == pytest.approx(0.02) and f["window_ms_per_step"] == pytest.approx(0.05)
    assert f["kernels_per_step"] == 2.0 and f["top_runtime_calls"][0]["name"] == "cudaGraphLaunch"
    assert f["top_kernels"][0] == {"name": "gemm", "per_step": 1.0, "us_per_step": 10.0}
    cpu = trace_busy_facts(parsed, cuda=False)
    assert cpu["busy_fraction"] is None and cpu["cpu_ops"] == 1


# ---------------------------------------------------------------------- CUDA: kernels in the core's trace
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("multiprocess", [False, True])
def test_cuda_trace_has_the_steps_kernels_and_a_busy_fraction(tiny_checkpoint, tmp_path, monkeypatch, multiprocess):
    """On CUDA (CUDA graphs on, the default) the core's trace holds its kernels, those replayed from graphs
    included (the core warms CUPTI before capturing them): at least one a layer a step."""
    monkeypatch.setenv(ENV, str(tmp_path))
    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    kw = dict(LLM_KW, device="cuda", dtype="bfloat16")
    kw.pop("num_threads")
    with LLM(model=tiny_checkpoint, multiprocess=multiprocess, **kw) as llm:
        llm.generate(["warm up"] * 4, PARAMS, use_tqdm=False)
        llm.start_profile()
        llm.generate(["The for statement", "def main():", "A class", "Exceptions"], PARAMS, use_tqdm=False)
        llm.stop_profile()
    (path,) = traces(tmp_path)
    facts = trace_busy_facts(read_chrome_trace(str(path)), cuda=True)
    assert facts["engine_steps"] >= PARAMS.max_tokens and 0 < facts["busy_fraction"] <= 1
    assert facts["kernels_per_step"] >= layers, facts
