"""Triton paged-attention and KV-writer kernels against the float64 oracle: interpreted on CPU, compiled on CUDA.

Triton chooses its interpreter when a kernel is decorated, for the whole process. So the CPU
cases run in one subprocess whose environment alone has TRITON_INTERPRET=1
(`python -m vllm_lite.testing.triton_cases`), and this process never sets it: where CUDA is
present the same checks run here natively, compiled, over the full matrix. The compiled path is
also checked without a GPU by compiling the kernel ahead of time for sm_90.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("package 'triton' is not installed (pip install 'vllm-lite[triton]')", allow_module_level=True)

from vllm_lite import envs  # noqa: E402
from vllm_lite.testing import triton_cases
from vllm_lite.testing.attention_oracle import random_attention_case  # noqa: E402
from vllm_lite.testing.triton_interpreter import compile_for_sm90, run_interpreter_driver  # noqa: E402
from vllm_lite.worker.attention.selector import get_attn_backend  # noqa: E402
from vllm_lite.worker.attention.triton_attn import TritonBackend  # noqa: E402

INTERPRETER_CHECKS = list(triton_cases.all_checks("cpu", full=False))
NATIVE_CHECKS = list(triton_cases.all_checks("cuda", full=True))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)")


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    """Every interpreter check, run once in a subprocess with TRITON_INTERPRET=1 in its environment only."""
    report = run_interpreter_driver("vllm_lite.testing.triton_cases")
    assert report["device"] == "cpu"
    return report["results"]


@pytest.mark.parametrize("name", INTERPRETER_CHECKS)
def test_kernel_in_triton_interpreter_matches_reference(interpreter_results, name):
    assert name in interpreter_results, f"the interpreter driver did not run {name}"
    failure = interpreter_results[name]
    assert failure is None, f"{name} failed under TRITON_INTERPRET=1:\n{failure}"


@needs_cuda
@pytest.mark.parametrize("name", NATIVE_CHECKS)
def test_compiled_kernel_on_cuda_matches_reference(name):
    assert not envs.TRITON_INTERPRET, "TRITON_INTERPRET is set: these would not be compiled kernels"
    triton_cases.all_checks("cuda", full=True)[name]()


def test_this_process_runs_triton_compiled_not_interpreted():
    # Nothing in the test process may turn the interpreter on for the tests after this module.
    assert not envs.TRITON_INTERPRET
    from vllm_lite.worker.attention import triton_attn

    assert type(triton_attn._paged_attention_kernel).__name__ == "JITFunction"


def test_arguments_that_change_every_step_are_not_specialised():
    """Triton compiles a kernel again for each new kind (== 1, a multiple of 16, other) of an int argument it
    specialises on; the step's request count and block-table width (attention) and its token-expert pairs (MoE)
    change from step to step, so specialising them compiles mid-serving (likely the H100 batch-1 TTFT of 310 ms)."""
    from vllm_lite.worker.attention import triton_attn
    from vllm_lite.worker.models import fused_moe_triton

    def unspecialised(kernel) -> set[str]:
        return {p.name for p in kernel.params if p.do_not_specialize}

    assert {"num_reqs", "stride_bt"} <= unspecialised(triton_attn._paged_attention_kernel)
    assert {"num_pairs"} <= unspecialised(fused_moe_triton._expert_gemm)


@pytest.mark.skipif(envs.TRITON_INTERPRET, reason="the check is about running without the interpreter")
def test_cpu_tensors_without_interpreter_raise_a_clear_error():
    query, cache, md = random_attention_case([1], [3], 2, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        TritonBackend().forward(query, cache, md, 1.0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("num_reqs", [1, 5])
def test_attention_kernel_compiles_for_sm90_ahead_of_time(dtype, num_reqs):
    # Without a GPU, compile the CUDA path to a cubin: catches Triton that only the interpreter accepts.

    from vllm_lite.worker.attention import triton_attn

    sig = {name: "*" + dtype for name in ("out_ptr", "q_ptr", "kv_ptr")}
    sig.update({name: "*i32" for name in ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr")})
    sig.update(
        scale="fp32",
        window="i32",
        soft_cap="fp32",
        num_reqs="i32",
        stride_q_tok="i32",
        stride_q_head="i32",
        stride_o_tok="i32",
    )
    sig.update(stride_o_head="i32", stride_bt="i32", kv_half="i64")
    consts = dict(
        BLOCK_SIZE=16,
        NUM_KV_HEADS=2,
        GROUP=4,
        HEAD_SIZE=96,
        HEAD_PAD=128,
        BLOCK_Q=16,
        BLOCK_M=64,
        TILE_N=32,
        DOT_IN_BF16=dtype == "bf16",
        INTERPRET=False,
        USE_WINDOW=num_reqs > 1,
        USE_SOFT_CAP=num_reqs > 1,
    )  # the windowed, soft-capped variant too
    if num_reqs == 1:  # Triton specialises an int argument equal to 1 to a constant
        consts["num_reqs"] = 1
    kernel = compile_for_sm90(triton_attn._paged_attention_kernel, sig, consts)
    assert "scf.for" in kernel.asm["ttir"], "the compiled kernel should loop over key tiles with scf.for"
    assert kernel.asm["cubin"]


def test_selector_forces_triton_by_name_and_env(monkeypatch):
    assert isinstance(get_attn_backend(torch.device("cpu"), "triton"), TritonBackend)
    monkeypatch.setenv("VLLM_LITE_ATTENTION_BACKEND", "triton")
    assert isinstance(get_attn_backend("cpu"), TritonBackend)
