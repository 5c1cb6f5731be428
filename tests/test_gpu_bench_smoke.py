"""benchmarks/gpu.py (issue #14's CUDA benchmark) on CPU: `--device cpu --smoke` runs every part of it
(checkpoint build, multiprocess engine, in-process profile worker with its decode and prefill step profiles,
HF worker) on a tiny shape and prints the JSON with every figure the issue asks for; `--compare-async` runs
both schedulings; the roofline, busy-fraction, device-event, phase-timer and cProfile arithmetic is checked on
numbers worked out by hand."""

from __future__ import annotations

import cProfile
import gzip
import json
import os
import pstats
import subprocess
import sys
import types

import pytest

from vllm_lite.testing.gpu_bench import (
    PhaseTimer,
    busy_fraction,
    compare_runs,
    config_facts,
    decode_step_cost,
    hf_config,
    host_time,
    plan_variants,
    roofline,
    summarize_device_events,
    summary_lines,
    top_functions,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_busy_fraction_counts_overlaps_once_and_clamps():
    assert busy_fraction([(0, 10), (5, 15), (20, 30)], 40) == pytest.approx(25 / 40)
    assert busy_fraction([(0, 10), (2, 3)], 20) == pytest.approx(0.5)  # nested: counted once
    assert busy_fraction([(0, 50)], 40) == 1.0
    assert busy_fraction([], 10) == 0.0
    assert busy_fraction([(0, 1)], 0) == 0.0


def test_decode_step_cost_and_roofline_llama_1b():
    facts = config_facts(hf_config("llama-1b").to_dict())
    h, inter, layers, vocab = 2048, 5632, 22, 8000
    per_layer = h * 64 * (32 + 2 * 4) + 32 * 64 * h + 3 * h * inter
    assert facts["matmul_params"] == layers * per_layer + h * vocab
    cost = decode_step_cost(facts, batch=256, sum_context=256 * 400, dtype_bytes=2)
    assert cost["weight_bytes"] == 2 * facts["matmul_params"]
    assert cost["kv_read_bytes"] == 256 * 400 * 2 * layers * 4 * 64 * 2
    assert cost["flops"] == 2 * facts["matmul_params"] * 256 + 4 * layers * 32 * 64 * 256 * 400
    r = roofline(cost, measured_ms=40.0, copy_bytes_per_s=3e12, matmul_flops_per_s=800e12)
    bytes_ms = 1e3 * (cost["weight_bytes"] + cost["kv_read_bytes"]) / 3e12
    flops_ms = 1e3 * cost["flops"] / 800e12
    assert r["bytes_ms"] == pytest.approx(bytes_ms, rel=1e-3)
    assert r["flops_ms"] == pytest.approx(flops_ms, rel=1e-3)
    assert r["roofline_ms"] == pytest.approx(max(bytes_ms, flops_ms), rel=1e-3)
    assert r["fraction_of_roofline"] == pytest.approx(max(bytes_ms, flops_ms) / 40.0, rel=1e-3)
    assert 1.0 < r["roofline_ms"] < 2.5  # the "about 1.5-2 ms a step" for this shape


def test_llama_8b_shape():
    facts = config_facts(hf_config("llama-8b").to_dict())
    assert (facts["num_layers"], facts["hidden_size"], facts["intermediate_size"]) == (32, 4096, 14336)
    assert (facts["num_heads"], facts["num_kv_heads"]) == (32, 8)
    per_layer = 4096 * 128 * (32 + 2 * 8) + 32 * 128 * 4096 + 3 * 4096 * 14336
    assert facts["matmul_params"] == 32 * per_layer + 4096 * 8000  # ~7.0e9


def test_summarize_device_events_cuda_kernels_copies_runtime():
    # Two steps over 100 us: kernels a (0-10, 50-60), b (5-20: overlaps a), a copy (70-80); 40 us busy.
    events = [("a", 0, 10), ("b", 5, 20), ("a", 50, 60), ("Memcpy HtoD", 70, 80)]
    runtime = [("cudaLaunchKernel", 0, 2), ("cudaLaunchKernel", 50, 52), ("cudaMemcpyAsync", 60, 90)]
    f = summarize_device_events(events, runtime, wall_us=100.0, steps=2, cuda=True)
    assert f["busy_fraction"] == pytest.approx(0.4)
    assert f["busy_ms_per_step"] == pytest.approx(0.02) and f["idle_ms_per_step"] == pytest.approx(0.03)
    assert f["profiled_step_ms"] == pytest.approx(0.05)
    assert f["kernels_per_step"] == 1.5 and f["copies_per_step"] == 0.5
    assert f["kernel_ms_per_step"] == pytest.approx(0.0175) and f["kernel_time_fraction"] == pytest.approx(0.35)
    assert [(k["name"], k["per_step"], k["us_per_step"]) for k in f["top_kernels"]] == [
        ("a", 1.0, 10.0),
        ("b", 0.5, 7.5),
    ]
    assert f["top_runtime_calls"][0] == {"name": "cudaMemcpyAsync", "per_step": 0.5, "us_per_step": 15.0}
    cpu = summarize_device_events(events[:2], [], wall_us=40.0, steps=1, cuda=False)
    assert "top_kernels" not in cpu and cpu["top_cpu_ops"][0]["name"] == "b"


def test_host_time_is_step_less_busy():
    h = host_time(step_ms=8.0, busy_fraction_=0.45, profiled_step_ms=8.0)
    assert h["gpu_busy_ms"] == pytest.approx(3.6) and h["host_ms"] == pytest.approx(4.4)
    assert h["host_fraction"] == pytest.approx(0.55)
    assert host_time(1.0, 1.0, 2.0)["host_ms"] == 0.0  # profiling slowed the device: clamped


class _Runner:
    def outer(self, x):
        return self.inner(x) + 1

    def inner(self, x):
        return x * 2


class _Slotted:
    __slots__ = ()

    def f(self):
        return 1


def test_phase_timer_nesting_self_time_and_restore():
    r = _Runner()
    mod = types.SimpleNamespace(fn=lambda: 7)
    timer = PhaseTimer()
    seen = []
    assert timer.wrap(r, "outer", "outer")
    assert timer.wrap(r, "inner", "inner", on_return=seen.append)
    assert timer.wrap(mod, "fn", "module.fn")
    assert not timer.wrap(r, "renamed_away", "gone") and not timer.wrap(None, "x", "none")
    assert not timer.wrap(_Slotted(), "f", "slotted")  # an object that takes no attributes: skipped, not raised
    assert timer.missing == ["gone", "none", "slotted"]
    assert r.outer(3) == 7 and r.outer(1) == 3 and mod.fn() == 7
    assert seen == [6, 2]
    out = timer.summary(steps=2)
    assert out["outer"]["calls_per_step"] == 1.0 and out["inner"]["parent"] == "outer"
    assert out["outer"]["parent"] is None and out["module.fn"]["calls_per_step"] == 0.5
    assert out["outer"]["self_us_per_step"] == pytest.approx(
        out["outer"]["us_per_step"] - out["inner"]["us_per_step"], abs=0.11
    )
    timer.restore()
    assert "outer" not in vars(r) and "inner" not in vars(r) and mod.fn() == 7 and mod.fn.__name__ == "<lambda>"


def test_phase_timer_wraps_a_class_method_and_restores_inheritance():
    class Child(_Runner):
        pass

    timer = PhaseTimer()
    assert timer.wrap(Child, "inner", "inner")
    assert Child().outer(2) == 5 and _Runner().outer(2) == 5
    assert timer.summary(1)["inner"]["calls_per_step"] == 1.0  # the parent class's objects are not timed
    timer.restore()
    assert "inner" not in vars(Child) and Child.inner is _Runner.inner


def _busy(n):
    return sum(i * i for i in range(n))


def test_top_functions_per_step():
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(4):
        _busy(20000)
    prof.disable()
    top = top_functions(pstats.Stats(prof), steps=2, n=10, sort="cumtime", only="test_gpu_bench")
    assert top[0]["function"].endswith("(_busy)") and top[0]["calls_per_step"] == 2.0
    assert top[0]["cum_us_per_step"] > 0 and len(top) <= 10
    assert all("test_gpu_bench" in t["function"] for t in top)


def test_plan_variants_and_compare_runs():
    s = {"enforce_eager": False, "compare_eager": False, "compare_async": True}
    fields = {"model", "async_scheduling"}
    assert plan_variants(s, True, fields) == {
        "graphs": (False, {"async_scheduling": False}),
        "async": (False, {"async_scheduling": True}),
    }
    assert plan_variants(s, False, fields) == {"graphs": (False, {})}  # batch-1-only shapes: no comparison
    old = plan_variants(s, True, {"model"})
    assert list(old) == ["graphs", "compare_async"] and old["compare_async"].startswith("unsupported")
    both = plan_variants(dict(s, compare_eager=True, enforce_eager=True), True, fields)
    assert list(both) == ["eager", "graphs", "async"] and both["async"] == (True, {"async_scheduling": True})

    def run(tps, ms, toks, b1):
        w = {"tokens_per_s": tps, "tokens": toks}
        return {"workload": w, "batch1": {"ms_per_token": ms, "ttft_ms": 1.0, "tokens": b1}, "time_to_ready_s": 1}

    c = compare_runs(
        "sync", run(100.0, 2.0, [[1, 2], [3, 4]], [[5]]), "async", run(150.0, 1.5, [[1, 2], [3, 9]], [[5]])
    )
    assert c["sync"]["tokens_per_s"] == 100.0 and c["async"]["batch1_ms_per_token"] == 1.5
    assert c["tokens_per_s_ratio"] == 1.5 and c["batch1_ms_per_token_ratio"] == 0.75
    assert not c["greedy_identical_workload"] and c["workload_sequences_differing"] == 1
    assert c["first_difference_workload"] == {"sequence": 1, "token": 1} and c["greedy_identical_batch1"]


def test_summary_lines_headline_figures():
    phases = {"scheduler.schedule": {"self_us_per_step": 600.0}, "model.forward": {"self_us_per_step": 900.0}}
    result = {
        "shapes": {
            "llama-1b": {
                "vllm_lite_tokens_per_s": 12522.1,
                "batch1_ttft_ms": 166.2,
                "errors": [],
                "decode_step": {
                    "measured_ms": 7.9,
                    "busy_ms_per_step": 3.6,
                    "kernel_ms_per_step": 3.5,
                    "kernels_per_step": 757.0,
                    "host": {"host_ms": 4.3},
                    "phases": phases,
                    "top_kernels": [{"name": "_paged_attention_kernel", "us_per_step": 1051.4}],
                },
                "prefill_step": {
                    "step_ms": 31.0,
                    "step_ms_median": 30.0,
                    "floor": {"roofline_ms": 5.2, "tokens_per_step": 2048},
                },
                "compare_async": {"tokens_per_s_ratio": 1.3, "greedy_identical_workload": True},
            },
            "llama-8b": {"compare_async": {"unsupported": "unsupported: no field"}, "errors": ["x"]},
        }
    }
    lines = summary_lines(result)
    assert lines[0] == "llama-1b: out tok/s 12522.1 TTFT 166.2 ms"
    assert lines[1] == "  decode_step: 7.9 ms/step, busy 3.6 ms, kernels 3.5 ms (757.0/step), host 4.3 ms"
    assert lines[2] == "    self us/step: model.forward 900.0, scheduler.schedule 600.0"
    assert lines[3] == "    top: _paged_attention_kernel 1051.4 us"
    assert lines[4] == "  prefill_step: 30.0 ms/step, floor 5.2 ms (2048 tok/step)"  # the median step
    assert lines[5].startswith("  compare_async: tok/s x1.3") and "workload True" in lines[5]
    assert lines[6:] == ["llama-8b: 1 errors", "  compare_async: unsupported: no field"]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


@pytest.mark.slow  # four interpreters (script, engine core, profile worker, HF worker): ~20 s
def test_smoke_run_prints_every_figure(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "gpu.py"), "--device", "cpu", "--smoke"],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout[-2000:]
    r = json.loads(lines[0])
    assert r["errors"] == []
    for key in ("device", "torch", "triton", "transformers", "settings", "probes"):
        assert key in r
    assert r["device"].startswith("cpu")
    s = r["settings"]
    assert s["dtype"] == "float32" and s["device"] == "cpu" and s["multiprocess"] is True
    assert _positive(r["probes"]["copy"]["bytes_per_s"]) and _positive(r["probes"]["matmul"]["flops_per_s"])

    t = r["shapes"]["tiny"]
    assert t["errors"] == []
    for key in (
        "vllm_lite_tokens_per_s",
        "hf_tokens_per_s",
        "ratio_vs_hf",
        "batch1_ms_per_token",
        "batch1_ttft_ms",
        "time_to_ready_s",
    ):
        assert _positive(t[key]), (key, t.get(key))
    assert t["output_tokens"] == s["num_prompts"] * s["output_len"]
    for key in ("gpu_busy_fraction", "gpu_busy_fraction_batch1"):
        assert 0.0 <= t[key] <= 1.0 and t[key] > 0, (key, t[key])
    for step in (t["decode_step"], t["batch1_decode_step"], t["decode_step_batch1_inprocess"]):
        for key in ("measured_ms", "bytes_moved", "flops", "bytes_ms", "flops_ms", "roofline_ms"):
            assert _positive(step[key]), (key, step)
        assert step["roofline_ms"] == max(step["bytes_ms"], step["flops_ms"])
        assert 0 < step["fraction_of_roofline"]
    assert t["decode_step"]["batch"] == s["num_prompts"]  # every prompt decoding in the profiled window
    assert t["batch1_decode_step"]["batch"] == 1
    assert t["decode_step"]["kv_read_bytes"] > t["batch1_decode_step"]["kv_read_bytes"]
    _check_step_profiles(t, s)


# The engine's functions every step goes through (schedule, input preparation, forward, sample, update, output).
CORE_PHASES = (
    "engine.step",
    "scheduler.schedule",
    "execute_model",
    "runner.build_step_inputs",
    "model.forward",
    "runner.sample",
    "sampler.forward",
    "scheduler.update_from_output",
    "output_processor.process_outputs",
)


def _check_step_profiles(t: dict, s: dict) -> None:
    """Decode (batch N, batch 1) and prefill (N prompts, batch 1) step profiles: profiled, timed by phase, top
    Python functions, host time."""
    steps = {
        "decode_step": t["decode_step"],
        "decode_step_batch1_inprocess": t["decode_step_batch1_inprocess"],
        "prefill_step": t["prefill_step"],
        "prefill_step_batch1": t["prefill_step_batch1"],
    }
    for label, st in steps.items():
        for name in CORE_PHASES:
            assert st["phases"][name]["calls_per_step"] >= 1, (label, name, st["phases"])
            assert st["phases"][name]["us_per_step"] > 0, (label, name)
        assert st["phases"]["scheduler.schedule"]["parent"] == "core.step", label
        assert st["phases"]["model.forward"]["parent"] == "runner.run_model", label
        assert 0 < len(st["top_functions"]) <= 10 and 0 < len(st["top_cumulative"]) <= 10, label
        assert all("vllm_lite" in f["function"] for f in st["top_cumulative"]), label
        assert _positive(st["cprofile_step_ms"]) and _positive(st["profiled_step_ms"]), label
        assert 0 < st["busy_fraction"] <= 1 and st["top_cpu_ops"], label
        assert st["host"]["step_ms"] > 0 and st["host"]["host_ms"] >= 0, label
    assert t["host_ms_per_decode_step"]["batch_n"] == t["decode_step"]["host"]
    pn, p1 = t["prefill_step"], t["prefill_step_batch1"]
    assert pn["requests"] == s["num_prompts"] and pn["steps"] == s["profile_steps"]
    assert pn["scheduled"]["prefill_requests_per_step"][0] == s["num_prompts"]  # the first step prefills them all
    assert len(pn["step_ms_each"]) == s["profile_steps"]
    assert p1["requests"] == 1 and p1["steps"] == s["prefill_b1_iters"]
    assert p1["scheduled"]["tokens_per_step"] == [s["batch1_input_len"]] * s["prefill_b1_iters"]
    assert p1["floor"]["tokens_per_step"] == s["batch1_input_len"] and _positive(p1["floor"]["flops_ms"])
    assert pn["floor"]["tokens_per_step"] == sum(pn["scheduled"]["tokens_per_step"]) / pn["steps"]


@pytest.mark.slow  # five interpreters (script, two engine cores, two profile workers): ~30 s
def test_smoke_compare_async_runs_both_and_compares_tokens_with_traces(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    argv = [sys.executable, os.path.join(REPO, "benchmarks", "gpu.py"), "--device", "cpu", "--smoke"]
    proc = subprocess.run(
        argv + ["--compare-async", "--skip-hf", "--trace-dir", str(tmp_path / "traces")],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    t = r["shapes"]["tiny"]
    assert t["errors"] == [] and r["settings"]["compare_async"] is True
    c = t["compare_async"]
    assert "unsupported" not in c  # this tree's EngineArgs has async_scheduling
    for label in ("sync", "async"):
        assert _positive(c[label]["tokens_per_s"]) and _positive(c[label]["batch1_ms_per_token"]), c
        for key in ("inprocess_batch_n", "inprocess_batch_1"):
            assert _positive(c[key][label]["measured_ms"]) and 0 < c[key][label]["busy_fraction"] <= 1, c[key]
    assert c["greedy_identical_workload"] is True and c["greedy_identical_batch1"] is True, c
    assert c["tokens_per_s_ratio"] == pytest.approx(c["async"]["tokens_per_s"] / c["sync"]["tokens_per_s"], rel=1e-2)
    assert set(t["part_seconds"]) == {"vllm_lite_graphs", "vllm_lite_async", "profile", "profile_mp", "profile_async"}
    assert c["default"] == "sync"  # on CPU the engine's default: the comparison run is the async one
    assert t["decode_step_async"]["batch"] == r["settings"]["num_prompts"]
    assert t["decode_step_async"]["phases"]["core.finish_oldest"]["calls_per_step"] > 0  # the async step's path
    # --trace-dir: a Chrome trace of each step profile (the async worker's decode ones too), with the phases' ranges
    names = {"tiny-bn", "tiny-b1", "tiny-pn", "tiny-p1", "tiny-async-bn", "tiny-async-b1"}
    assert sorted(os.listdir(tmp_path / "traces")) == sorted(f"{n}.json.gz" for n in names)
    assert t["prefill_step"]["trace"] == {"file": "tiny-pn.json.gz", "steps": 2}
    with gzip.open(tmp_path / "traces" / "tiny-pn.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    ranges = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"scheduler.schedule", "model.forward", "scheduler.update_from_output"} <= ranges


# ------------------------------------------------------------------ --time-limit, SIGTERM, --out-json (cut short)
GPU_PY = os.path.join(REPO, "benchmarks", "gpu.py")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's parent may not have reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


@pytest.fixture(scope="module")
def gpu_bench():
    import importlib.util

    env, path = dict(os.environ), list(sys.path)
    spec = importlib.util.spec_from_file_location("gpu_bench_script", GPU_PY)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:  # the script puts the tree on PYTHONPATH and sys.path for its children: not this process's
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
    return module


def test_a_worker_gets_only_the_time_left_and_is_killed_at_the_deadline(gpu_bench, monkeypatch):
    """run_worker's subprocess timeout is the time left before the soft deadline (less a margin), not
    --worker-timeout: a worker that never ends is killed with its process group and the run stops (TimeLimit)."""
    import time

    monkeypatch.setitem(gpu_bench.RUN, "soft_deadline", time.perf_counter() + 2.0)
    monkeypatch.setitem(gpu_bench.RUN, "stop_reason", None)
    with pytest.raises(gpu_bench.TimeLimit, match="--time-limit reached: the hang worker") as stop:
        gpu_bench.run_worker("hang", {}, timeout_s=120.0)  # broken: RuntimeError (--worker-timeout) in 120 s
    assert stop.value.worker_pid is not None and not _alive(stop.value.worker_pid)
    assert gpu_bench.RUN["worker"] is None
    # Past the deadline no worker starts at all.
    monkeypatch.setitem(gpu_bench.RUN, "soft_deadline", time.perf_counter() - 1.0)
    with pytest.raises(gpu_bench.TimeLimit, match="no time left"):
        gpu_bench.run_worker("hang", {}, timeout_s=120.0)


def test_without_a_deadline_a_worker_gets_worker_timeout(gpu_bench, monkeypatch):
    monkeypatch.setitem(gpu_bench.RUN, "soft_deadline", None)
    with pytest.raises(RuntimeError, match="ran past --worker-timeout"):
        gpu_bench.run_worker("hang", {}, timeout_s=1.0)


_KILLED_PARENT = """
import importlib.util, sys, threading, time
spec = importlib.util.spec_from_file_location("g", sys.argv[1])
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)

def tell():
    deadline = time.monotonic() + 120.0  # poll with a deadline: the parent fails the test if nothing comes
    while g.RUN["worker"] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if g.RUN["worker"] is not None:
        print(g.RUN["worker"].pid, flush=True)

threading.Thread(target=tell, daemon=True).start()
g.run_worker("hang", {}, timeout_s=600.0)
"""


def test_a_worker_dies_with_a_run_killed_outright():
    """A worker leads its own process group (a signal to the run's group misses it): SIGKILL of the run itself
    must not leave it running (PR_SET_PDEATHSIG)."""
    from vllm_lite.testing.waiting import wait_until

    parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT, GPU_PY], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not _alive(worker), 60, f"worker {worker} gone after its parent was killed")


def test_time_limit_is_a_hard_wall_the_watchdog_prints_kills_and_exits(tmp_path):
    """--test-hang main: the main thread swallows every TimeLimit (a stuck shutdown) and has started a child
    process: at --time-limit the watchdog kills the child, prints the JSON it has (also to --out-json), exits 1."""
    out = tmp_path / "r.json"
    argv = [sys.executable, GPU_PY, "--device", "cpu", "--smoke", "--time-limit", "8", "--test-hang", "main"]
    proc = subprocess.run(argv + ["--out-json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = _json_lines(proc.stdout)
    assert len(lines) == 1, proc.stdout[-2000:]
    r = lines[0]
    assert "hard wall" in r["stopped"] and r["partial"] is True
    from vllm_lite.testing.waiting import wait_until

    child = r["test_child_pid"]
    assert child in r["killed_pids"]
    # SIGKILL is delivered asynchronously: on a loaded host the child can still be running for a moment after
    # the watchdog's kill() returned and its process exited.
    wait_until(lambda: not _alive(child), 30, "the killed child to be gone")
    assert json.loads(out.read_text()) == r  # the file holds what was printed


@pytest.mark.slow  # three interpreters (script, engine core, profile worker): ~15 s
def test_sigterm_mid_run_prints_what_it_has_with_the_workers_partial_figures(tmp_path):
    """--out-json holds the figures of each finished part while the run goes; SIGTERM (what `timeout` sends)
    stops it: the hung profile worker is killed, its finished measurement (decode at batch N) is kept, the JSON
    is printed and written, exit 1."""
    from vllm_lite.testing.waiting import wait_until

    out, err = tmp_path / "r.json", tmp_path / "stderr.log"
    argv = [sys.executable, GPU_PY, "--device", "cpu", "--smoke", "--skip-hf", "--skip-mp-profile"]
    argv += ["--test-hang", "profile", "--time-limit", "0", "--out-json", str(out)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with open(err, "w") as ferr:
        proc = subprocess.Popen(argv, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=ferr, text=True)
    try:
        wait_until(lambda: "profile worker hangs" in err.read_text() or proc.poll() is not None, 300, "the hang")
        assert proc.poll() is None, err.read_text()[-3000:]
        during = json.loads(out.read_text())  # written after the engine part, before the profile worker
        assert during["partial"] is True and during["stopped"] is None
        assert _positive(during["shapes"]["tiny"]["vllm_lite_tokens_per_s"])
        assert "FIGURES tiny vllm-lite graphs: tok/s" in err.read_text()  # the part's progress line
        proc.send_signal(subprocess.signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err.read_text()[-3000:]
    lines = _json_lines(stdout)
    assert len(lines) == 1, stdout[-2000:]
    r = lines[0]
    assert r["stopped"] == "signal SIGTERM received" and r["partial"] is True
    t = r["shapes"]["tiny"]
    assert _positive(t["vllm_lite_tokens_per_s"]) and _positive(t["decode_step"]["measured_ms"])  # kept
    assert "prefill_step" not in t  # never measured
    assert any("its finished measurements are kept" in e for e in t["errors"]), t["errors"]
    assert t["stopped_worker"]["part"] == "profile" and not _alive(t["stopped_worker"]["pid"])
    assert json.loads(out.read_text()) == r
