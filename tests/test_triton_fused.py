"""The fused Triton layer kernels (RMSNorm + residual, SiLU/GELU-tanh-and-mul, rotary with the K/V cache write)
against the torch code they replace: interpreted on CPU, compiled on CUDA; and the layers' choice of path.

Triton chooses its interpreter when a kernel is decorated, for the whole process, so the CPU cases run in one
subprocess whose environment alone has TRITON_INTERPRET=1 (`python -m vllm_lite.testing.triton_fused_cases`);
this process never sets it. Where CUDA is present the same checks run here, compiled (test_compiled_*_cuda).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("package 'triton' is not installed (pip install 'vllm-lite[triton]')", allow_module_level=True)

from vllm_lite import envs  # noqa: E402
from vllm_lite.testing import triton_fused_cases  # noqa: E402
from vllm_lite.testing.triton_interpreter import child_env, compile_for_sm90, run_interpreter_driver  # noqa: E402
from vllm_lite.worker.models import layers, triton_fused  # noqa: E402
from vllm_lite.worker.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, fused_kernel_path  # noqa: E402

CHECKS = list(triton_fused_cases.all_checks("cpu"))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)")


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    """Every check, run once in a subprocess with TRITON_INTERPRET=1 in its environment only."""
    report = run_interpreter_driver("vllm_lite.testing.triton_fused_cases")
    assert report["device"] == "cpu"
    return report["results"]


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_in_triton_interpreter_matches_torch(interpreter_results, name):
    assert name in interpreter_results, f"the interpreter driver did not run {name}"
    failure = interpreter_results[name]
    assert failure is None, f"{name} failed under TRITON_INTERPRET=1:\n{failure}"


@needs_cuda
@pytest.mark.parametrize("name", list(triton_fused_cases.all_checks("cuda")))
def test_compiled_kernel_on_cuda_matches_torch(name):
    assert not envs.TRITON_INTERPRET, "TRITON_INTERPRET is set: these would not be compiled kernels"
    triton_fused_cases.all_checks("cuda")[name]()


@needs_cuda
@torch.inference_mode()
def test_compiled_kernels_capture_and_replay_in_a_cuda_graph_cuda():
    """Norm, activation and rotary + K/V write captured in one CUDA graph give the eager results on replay with
    new inputs (no host sync, no allocation that depends on values)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    t, heads, kvh, d, hidden = 8, 4, 2, 64, 256
    norm = RMSNorm(hidden).to(dev, dt)
    act = SiluAndMul()
    rope = RotaryEmbedding(d, 512, {"rope_theta": 10000.0, "rope_type": "default"}).to(dev)
    x, res = torch.randn(t, hidden, device=dev, dtype=dt), torch.randn(t, hidden, device=dev, dtype=dt)
    gate_up = torch.randn(t, 2 * hidden, device=dev, dtype=dt)
    qkv = torch.randn(t, (heads + 2 * kvh) * d, device=dev, dtype=dt)
    pos = torch.randint(0, 512, (t,), device=dev)
    slots = torch.randperm(32, device=dev)[:t]
    cache = torch.zeros(2, 8, 4, kvh, d, device=dev, dtype=dt)

    def step():
        y, r = norm(x, res)
        a = act(gate_up)
        q, k, v = qkv.clone().split([heads * d, kvh * d, kvh * d], dim=-1)
        assert rope.rotate_and_write_kv(pos, q, k, v, cache, slots)
        return y, r, a, q

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for src in (x, res, gate_up, qkv):
        src.copy_(torch.randn_like(src))
    pos.copy_(torch.randint(0, 512, (t,), device=dev))
    graph.replay()
    graph_cache = cache.clone()
    cache.zero_()
    want = step()
    for got, exp in zip(outs, want):
        assert torch.equal(got, exp)
    assert torch.equal(graph_cache, cache)


def test_cuda_takes_the_triton_path_and_cpu_keeps_its_own():
    """The decoder layers' choice (fused_kernel_path), asked for CUDA on any host."""
    assert fused_kernel_path("cuda", torch.bfloat16) == "triton"
    assert fused_kernel_path("cuda", torch.float32) == "triton"
    assert fused_kernel_path("cuda", torch.float16) == "triton"
    assert fused_kernel_path("cuda", torch.bfloat16, grad=True) == "torch"
    assert fused_kernel_path("cuda", torch.float64) == "torch"
    cpu = "cpu" if layers.fused_cpu_ops() is not None else "torch"
    assert fused_kernel_path("cpu", torch.bfloat16) == cpu
    assert fused_kernel_path("cpu", torch.float16) == "torch"


@torch.inference_mode()
def test_cpu_layers_never_call_the_triton_kernels(monkeypatch):
    calls: list[str] = []
    for name in ("rms_norm", "act_and_mul", "rotary", "rotary_write_kv"):
        monkeypatch.setattr(triton_fused, name, lambda *a, name=name, **k: calls.append(name))
    x = torch.randn(3, 64)
    RMSNorm(64)(x, x.clone())
    SiluAndMul()(x)
    rope = RotaryEmbedding(16, 32, {"rope_theta": 10000.0, "rope_type": "default"})
    rope(torch.tensor([1, 2, 3]), torch.randn(3, 32), torch.randn(3, 16))
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    assert not rope.rotate_and_write_kv(torch.tensor([1, 2, 3]), q, k, v, torch.zeros(2, 2, 2, 1, 16), torch.arange(3))
    assert calls == []


def test_interpreter_switch_needs_the_interpreter():
    assert not envs.TRITON_INTERPRET
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with layers.triton_on_cpu_under_interpreter():
            pass
    assert layers._TRITON_ON_CPU == [False]


def test_blocks_being_compiled_take_the_torch_path(monkeypatch):
    """Under torch.compile tracing (compilation_config) the layers never launch the Triton kernels themselves."""
    x = torch.zeros(4, 8)
    monkeypatch.setattr(layers, "_TRITON_ON_CPU", [True])  # as on CUDA: the Triton path is the layers' choice
    monkeypatch.setattr(layers, "_takes_triton", lambda *args: True)
    assert layers.triton_fused_for(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not layers.triton_fused_for(x)


def test_cpu_processes_do_not_import_triton():
    """Importing the models (and running them on CPU) leaves triton unimported: its import costs ~0.2 s."""
    code = (
        "import sys, torch\n"
        "from vllm_lite.worker.models import llama\n"
        "from vllm_lite.worker.models.layers import RMSNorm, SiluAndMul\n"
        "x = torch.randn(2, 8)\n"
        "with torch.inference_mode():\n"
        "    RMSNorm(8)(x, x.clone()); SiluAndMul()(x)\n"
        "print('triton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.skipif(envs.TRITON_INTERPRET, reason="the check is about running without the interpreter")
def test_cpu_tensors_without_interpreter_raise_a_clear_error():
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_fused.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="act must be one of"):
        triton_fused.act_and_mul(torch.randn(2, 8), "relu")


def test_supported_checks_refuse_what_the_kernels_cannot_take():
    x, w = torch.randn(4, 8), torch.ones(8)
    assert triton_fused.rms_norm_supported(x, w)
    assert not triton_fused.rms_norm_supported(x.t(), torch.ones(4))  # last dim not packed
    assert not triton_fused.rms_norm_supported(x, torch.ones(7))
    assert not triton_fused.rms_norm_supported(x.view(4, 2, 4), torch.ones(4), torch.randn(4, 2, 4))  # 3-D + res
    assert not triton_fused.rms_norm_supported(x.double(), w.double())
    assert triton_fused.act_and_mul_supported(x) and not triton_fused.act_and_mul_supported(torch.randn(4, 7))
    pos, table = torch.arange(4), torch.randn(16, 8)
    q, k = torch.randn(4, 32), torch.randn(4, 16)
    assert triton_fused.rotary_supported(pos, q, k, table, 16, 8)
    assert not triton_fused.rotary_supported(pos, q, k, table, 16, 7)  # odd rotary_dim
    assert not triton_fused.rotary_supported(pos, q, k, table.half(), 16, 8)
    assert not triton_fused.rotary_supported(pos[:3], q, k, table, 16, 8)
    cache = torch.zeros(2, 3, 4, 1, 16)
    assert triton_fused.rotary_write_kv_supported(k, k.clone(), cache, pos)
    assert not triton_fused.rotary_write_kv_supported(k, k.clone(), cache.half(), pos)
    assert not triton_fused.rotary_write_kv_supported(k, k.clone(), cache.transpose(0, 1), pos)


def _compile_for_sm90(fn, sig: dict, consts: dict):
    assert compile_for_sm90(fn, sig, consts).asm["cubin"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("variant", ["plain", "residual", "gemma_add"])
def test_rms_norm_kernel_compiles_for_sm90_ahead_of_time(dtype, variant):
    # Without a GPU, compile the CUDA path to a cubin: catches Triton that only the interpreter accepts.
    sig = {name: "*" + dtype for name in ("x_ptr", "res_ptr", "w_ptr", "y_ptr", "res_out_ptr")}
    sig.update({name: "i32" for name in ("stride_x0", "stride_x1", "stride_r", "stride_y", "stride_ro", "n1", "N")})
    sig["eps"] = "fp32"
    consts = dict(
        HAS_RES=variant == "residual", POST_ADD=variant == "gemma_add", GEMMA=variant == "gemma_add", BLOCK=2048
    )
    _compile_for_sm90(triton_fused._rms_norm_kernel, sig, consts)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("act", [0, 1])
def test_act_and_mul_kernel_compiles_for_sm90_ahead_of_time(dtype, act):
    sig = {"x_ptr": "*" + dtype, "y_ptr": "*" + dtype, "stride_x": "i32", "stride_y": "i32", "D": "i32"}
    _compile_for_sm90(triton_fused._act_and_mul_kernel, sig, dict(ACT=act, BLOCK=1024))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("write_kv", [False, True])
def test_rotary_kernel_compiles_for_sm90_ahead_of_time(dtype, write_kv):
    sig = {name: "*" + dtype for name in ("q_ptr", "k_ptr", "v_ptr", "kv_ptr")}
    sig.update(pos_ptr="*i64", cs_ptr="*fp32", slot_ptr="*i64")
    sig.update({name: "i32" for name in ("stride_q", "stride_k", "stride_v", "stride_cs")})
    sig["kv_half"] = "i64"
    consts = dict(
        NUM_Q_HEADS=32,
        NUM_KV_HEADS=4,
        Q_PAD=32,
        KV_PAD=4,
        HEAD=96,  # partial rotary of a head that is not a power of two (Phi-3-like)
        HEAD_PAD=128,
        HALF=24,
        HALF_PAD=32,
        WRITE_KV=write_kv,
    )
    _compile_for_sm90(triton_fused._rotary_kernel, sig, consts)
