"""The platform module's answers agree with what this machine actually does, and are probed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_lite import platform
from vllm_lite.platform import resolve_device


def _cpuinfo_flags() -> set[str]:
    """The oracle: the kernel's own flag list, read independently of the module under test."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.split(":", 1)[0].strip() in ("flags", "Features"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_native_bf16_matches_the_cpu_flags() -> None:
    flags = _cpuinfo_flags()
    assert set(platform.cpu_flags()) == flags
    assert platform.cpu_has_native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)


def test_capability_is_torchs_dispatch_level() -> None:
    assert platform.cpu_capability() == torch.backends.cpu.get_cpu_capability()


def test_onednn_prepack_probe_agrees_with_packing_a_real_weight() -> None:
    """Pack a larger weight the way the worker does: the probe must have said the same. Small random
    integers keep every sum exact, so a correct kernel matches F.linear bit for bit."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-3, 4, (96, 256), generator=g).to(torch.bfloat16)
    x = torch.randint(-3, 4, (5, 256), generator=g).to(torch.bfloat16)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        works, why = torch.equal(y, torch.nn.functional.linear(x, w)), "packed result differs"
    except (RuntimeError, AttributeError) as e:
        works, why = False, str(e)
    probe = platform.onednn_bf16_prepack()
    assert probe.ok == works, (probe, why)
    assert bool(probe) == probe.ok
    assert probe.ok or probe.reason  # a "no" always says why (it goes into the load log)


def test_probes_run_once() -> None:
    assert platform.onednn_bf16_prepack() is platform.onednn_bf16_prepack()
    assert platform.host_facts() is platform.host_facts()
    assert platform.onednn_bf16_prepack.cache_info().misses <= 1


def test_cuda_answers_match_torch() -> None:
    assert platform.cuda_available() == torch.cuda.is_available()
    assert platform.cuda_device_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert len(platform.cuda_device_names()) == platform.cuda_device_count()
    if not platform.cuda_available():
        assert not platform.cuda_bf16_supported()


def test_resolve_device() -> None:
    assert resolve_device("auto").type == ("cuda" if platform.cuda_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    if not platform.cuda_available():
        with pytest.raises(ValueError, match="no usable CUDA device"):
            resolve_device("cuda")


def test_native_kernels_report_the_loaders_result() -> None:
    """Before the loader runs: whether a compiler is there; after: what the loader found (here, in a fresh
    process, so this process's loader state is left alone)."""
    code = (
        "from vllm_lite import platform\n"
        "before = platform.native_kernels_loaded()\n"
        "from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops\n"
        "ok = load_cpu_ops()\n"
        "print(before, ok, platform.native_kernels_loaded(), platform.native_kernels().ok)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    before, ok, after, usable = out.stdout.split()
    assert before == "None" and after == ok and usable == ok


def test_missing_compiler_is_reported_without_building(tmp_path) -> None:
    env = {**os.environ, "CXX": "/nonexistent/c++", "VLLM_LITE_CACHE_DIR": str(tmp_path)}
    code = "from vllm_lite import platform; c = platform.native_kernels(); print(c.ok, platform.cxx_compiler()); print(c.reason)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "False None"
    assert "no C++ compiler" in out.stdout
    assert list(tmp_path.iterdir()) == []  # the probe built nothing


def test_describe_host_is_what_benchmarks_print() -> None:
    d = platform.describe_host()
    json.dumps(d)  # printable as one JSON line
    assert d["cpu_model"] == platform.cpu_model_name() and d["cpu_model"]
    assert d["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert d["cpu_native_bf16"] == platform.cpu_has_native_bf16()
    assert d["onednn_bf16_prepack"] == platform.onednn_bf16_prepack().ok
    assert d["cpu_affinity"] == len(os.sched_getaffinity(0)) and d["cpu_count"] == os.cpu_count()
    assert d["torch"] == torch.__version__
    assert d["cuda_devices"] == list(platform.cuda_device_names())


def test_module_imports_nothing_above_it() -> None:
    """Top level: platform must not pull in client/core/worker/entrypoints (dependencies point downward)."""
    code = (
        "import sys, vllm_lite.platform, vllm_lite.dtype_policy\n"
        "bad = [m for m in sys.modules if m.startswith(('vllm_lite.client', 'vllm_lite.core', "
        "'vllm_lite.worker', 'vllm_lite.entrypoints'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_bench_json_adds_the_host_to_a_benchmark_line() -> None:
    from vllm_lite.testing.baselines import bench_json

    line = bench_json({"benchmark": "x", "tok_per_s": 1.5})
    assert "\n" not in line
    d = json.loads(line)
    assert d["benchmark"] == "x" and d["tok_per_s"] == 1.5
    assert d["host"]["cpu_model"] == platform.cpu_model_name()
    assert d["host"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_a_benchmark_line_says_whether_the_kernels_load_even_where_its_engine_runs_elsewhere() -> None:
    """A fresh process (as a benchmark whose engine core is another process): the line still says True or False."""
    code = "from vllm_lite.testing.baselines import bench_json; print(bench_json({}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    host = json.loads(out.stdout.strip().splitlines()[-1])["host"]
    assert host["native_kernels_loaded"] is not None


def test_every_benchmark_prints_the_machine_it_ran_on() -> None:
    """Issue #15: every benchmark says which CPU (model, capability) its figures come from."""
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    scripts = sorted(f for f in os.listdir(bench_dir) if f.endswith(".py"))
    assert len(scripts) > 20
    markers = ("bench_json(", "describe_host()", "host_description()")
    missing = []
    for name in scripts:
        with open(os.path.join(bench_dir, name)) as f:
            src = f.read()
        if "__main__" in src and not any(m in src for m in markers):
            missing.append(name)
    assert missing == []
