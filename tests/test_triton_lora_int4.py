"""LoRA SGMV/BGMV and int4 AWQ/GPTQ Triton kernels: interpreted on CPU, compiled for sm_90, native on CUDA.

The interpreter cases run in one subprocess whose environment alone has TRITON_INTERPRET=1
(`python -m vllm_lite.testing.triton_cases --suite lora_int4`); it starts before the ahead-of-time
compile checks so the two overlap. Where CUDA is present the full matrix runs here, compiled.
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
from vllm_lite.lora import triton_ops  # noqa: E402
from vllm_lite.quantization import packing, triton_int4  # noqa: E402
from vllm_lite.testing import lora_int4_oracle as oracle  # noqa: E402
from vllm_lite.testing import triton_lora_int4_cases as cases  # noqa: E402
from vllm_lite.testing.devices import requires_cuda_devices  # noqa: E402
from vllm_lite.testing.triton_interpreter import compile_for_sm90, interpreter_env, last_report  # noqa: E402

INTERPRETER_CHECKS = list(cases.all_checks("cpu", full=False))
NATIVE_CHECKS = list(cases.all_checks("cuda", full=True))


@pytest.fixture(scope="module", autouse=True)
def interpreter_proc():
    """The interpreter subprocess, started once when the module begins (TRITON_INTERPRET in its env only)."""
    cmd = [sys.executable, "-m", "vllm_lite.testing.triton_cases", "--device", "cpu", "--suite", "lora_int4"]
    proc = subprocess.Popen(cmd, env=interpreter_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def interpreter_results(interpreter_proc) -> dict:
    out, err = interpreter_proc.communicate(timeout=900)
    report = last_report(out, err, interpreter_proc.returncode)
    assert report["device"] == "cpu" and report["suite"] == "lora_int4"
    return report["results"]


@pytest.mark.parametrize("name", INTERPRETER_CHECKS)
def test_kernel_in_triton_interpreter_matches_oracle(interpreter_results, name):
    assert name in interpreter_results, f"the interpreter driver did not run {name}"
    failure = interpreter_results[name]
    assert failure is None, f"{name} failed under TRITON_INTERPRET=1:\n{failure}"


@requires_cuda_devices(1)
@pytest.mark.parametrize("name", NATIVE_CHECKS)
def test_compiled_kernel_on_cuda_matches_oracle(name):
    assert not envs.TRITON_INTERPRET, "TRITON_INTERPRET is set: these would not be compiled kernels"
    cases.all_checks("cuda", full=True)[name]()


# ------------------------------------------------------------------------ compiled for sm_90 without a GPU


def _lora_sig(kernel: str, w: str, out: str) -> dict:
    sig = {"in_ptr": "*fp32" if out != "*fp32" else f"*{w}", "w_ptr": f"*{w}", "out_ptr": out}
    if kernel == "sgmv":
        sig.update(sorted_tokens_ptr="*i32", slot_start_ptr="*i32", slot_count_ptr="*i32")
    else:
        sig.update(slots_ptr="*i32", num_slots="i32")
    for name in ("n_out", "k_in", "stride_in_t", "stride_w_s", "stride_w_n", "stride_out_t"):
        sig[name] = "i32"
    return sig


@pytest.mark.parametrize("kernel,role,w", [("sgmv", "shrink", "bf16"), ("bgmv", "expand", "fp16")])
def test_lora_kernel_compiles_for_sm90_ahead_of_time(kernel, role, w):
    # Unit strides are specialised to constants, as Triton does when a stride argument equals 1.
    expand = role == "expand"
    sig = _lora_sig(kernel, w, f"*{w}" if expand else "*fp32")
    consts = dict(stride_in_k=1, stride_w_k=1, stride_out_n=1, ACCUMULATE=expand, SPLIT_K=1 if expand else 4)
    if kernel == "sgmv":
        consts.update(W_F32=w == "fp32", INTERPRET=False, BLOCK_M=16, BLOCK_N=16 if not expand else 128)
        consts["BLOCK_K"] = 64 if not expand else 16
    else:
        consts.update(BLOCK_N=16 if not expand else 64, BLOCK_K=128 if not expand else 16)
    fn = triton_ops._sgmv_kernel if kernel == "sgmv" else triton_ops._bgmv_kernel
    compiled = compile_for_sm90(fn, sig, consts)
    assert compiled.asm["cubin"]
    ptx = compiled.asm["ptx"]
    if not expand:
        assert "atom" in ptx or "red." in ptx, "a split-K shrink must add its partial sums atomically"
    if kernel == "sgmv" and w != "fp32":
        assert "mma" in ptx, "the SGMV kernel's half-precision dot should use tensor cores"


def test_fused_sub_expand_compiles_for_sm90_ahead_of_time():
    # One BGMV launch for every sub-projection of a fused layer (ops.add_lora_triton via lora_expand_subs).
    sig = {"in_ptr": "*fp32", "w0_ptr": "*bf16", "w1_ptr": "*bf16", "w2_ptr": "*bf16", "out_ptr": "*bf16"}
    sig.update(slots_ptr="*i32")
    for name in ("num_slots", "n_out", "rank", "start1", "start2", "stride_in_t", "stride_w0_s", "stride_w1_s"):
        sig[name] = "i32"
    sig.update(stride_w2_s="i32", stride_w_n="i32", stride_out_t="i32")
    consts = dict(stride_in_k=1, stride_w_k=1, stride_out_n=1, BLOCK_N=64, BLOCK_K=16)
    compiled = compile_for_sm90(triton_ops._bgmv_expand_subs_kernel, sig, consts)
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("fmt,dtype,g_idx,block_m", [("awq", "fp16", False, 16), ("gptq", "bf16", True, 64)])
def test_int4_kernel_compiles_for_sm90_ahead_of_time(fmt, dtype, g_idx, block_m):
    sig = {"x_ptr": f"*{dtype}", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": f"*{dtype}"}
    sig.update(g_idx_ptr="*i32", out_ptr=f"*{dtype}" if block_m > 16 else "*fp32")
    sig.update({name: "i32" for name in ("M", "N", "K", "group_size", "stride_xm", "stride_qw", "stride_qz")})
    sig.update(stride_s="i32", stride_om="i32", split_k="i32")
    block_n, block_k = (64, 64) if block_m <= 32 else (64, 32)
    consts = dict(
        stride_xk=1,
        AWQ=fmt == "awq",
        BITS=4,
        ZERO_OFFSET=1 if fmt == "gptq" else 0,
        HAS_G_IDX=g_idx,
        ONE_GROUP_PER_TILE=not g_idx,
        ATOMIC=block_m == 16,
        X_F32=False,
        INTERPRET=False,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        WIDE_LOAD=True,
    )
    compiled = compile_for_sm90(triton_int4._int4_gemm_kernel, sig, consts)
    assert compiled.asm["cubin"]
    assert "mma" in compiled.asm["ptx"], "the dequantized tile should meet the activations in a tensor-core dot"


# ------------------------------------------------------------------------------------------ host side


def test_this_process_runs_triton_compiled_not_interpreted():
    assert not envs.TRITON_INTERPRET
    assert type(triton_ops._sgmv_kernel).__name__ == "JITFunction"
    assert type(triton_int4._int4_gemm_kernel).__name__ == "JITFunction"


@pytest.mark.skipif(envs.TRITON_INTERPRET, reason="the check is about running without the interpreter")
def test_cpu_tensors_without_interpreter_raise_a_clear_error():
    x, a = torch.randn(2, 16), torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_ops.lora_shrink(x, a, torch.zeros(2, dtype=torch.int32))
    q = oracle.random_awq_case(1, 32, 8, 32, torch.float16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_int4.awq_gemm(q.x, q.qweight, q.qzeros, q.scales, 32)


def test_grouping_sorts_tokens_by_slot_stably_and_drops_no_adapter_tokens():
    slots = torch.tensor([2, -1, 0, 2, 5, 0, 2], dtype=torch.int32)  # 5: past a 3-slot table
    g = triton_ops.group_tokens_by_slot(slots, 3)
    assert g.slot_count.tolist() == [2, 0, 3]
    assert g.slot_start.tolist() == [0, 2, 2]
    assert g.sorted_tokens[:5].tolist() == [2, 5, 0, 3, 6]
    assert sorted(g.sorted_tokens[5:].tolist()) == [1, 4]
    assert all(t.dtype == torch.int32 for t in g)


def _shrink(**over):
    args = dict(x=torch.randn(3, 8), lora_a=torch.randn(2, 4, 8), token_slots=torch.zeros(3, dtype=torch.int32))
    args.update(over)
    return lambda: triton_ops.lora_shrink(**args)


def _expand(**over):
    args = dict(
        y=torch.randn(3, 8),
        buf=torch.randn(3, 4),
        lora_b=torch.randn(2, 8, 4),
        token_slots=torch.zeros(3, dtype=torch.int32),
    )
    args.update(over)
    return lambda: triton_ops.lora_expand(**args)


def test_step_slots_share_one_grouping_only_for_the_declared_tensor():
    slots = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    try:
        triton_ops.set_step_slots(slots)
        first = triton_ops._grouping_for(slots, 2)
        assert triton_ops._grouping_for(slots, 2) is first, "layers of one step should share the sort"
        assert first.slot_count.tolist() == [1, 2]
        other = slots.flip(0)  # another tensor (the next step's) is grouped afresh
        assert triton_ops._grouping_for(other, 2).sorted_tokens.tolist()[:3] == [1, 0, 3]
        assert triton_ops._grouping_for(slots, 3).slot_count.tolist() == [1, 2, 0]
        triton_ops.set_step_slots(None)
        assert triton_ops._grouping_for(slots, 2) is not first
    finally:
        triton_ops.set_step_slots(None)


@pytest.mark.parametrize(
    "call,exc,field",
    [
        (_shrink(lora_a=torch.randn(2, 4, 9)), ValueError, "input size"),
        (_shrink(token_slots=torch.zeros(3)), TypeError, "token_slots"),
        (_shrink(token_slots=torch.zeros(2, dtype=torch.int32)), ValueError, "token_slots"),
        (_shrink(method="dense"), ValueError, "method"),
        (_shrink(split_k=0), ValueError, "split_k"),
        (_expand(out_offset=1), ValueError, "out_offset"),
        (_expand(lora_b=torch.randn(2, 8, 5)), ValueError, "rank"),
        (_expand(buf=torch.randn(2, 4)), ValueError, "buf"),
    ],
)
def test_lora_kernels_refuse_bad_input_naming_the_field(call, exc, field):
    with pytest.raises(exc, match=field):
        call()


def _awq(**over):
    q = oracle.random_awq_case(2, 64, 16, 32, torch.float16)
    args = dict(x=q.x, qweight=q.qweight, qzeros=q.qzeros, scales=q.scales, group_size=32)
    args.update(over)
    return lambda: triton_int4.awq_gemm(**args)


def _gptq(**over):
    q = oracle.random_gptq_case(2, 64, 16, 32, torch.float16)
    args = dict(x=q.x, qweight=q.qweight, qzeros=q.qzeros, scales=q.scales, g_idx=q.g_idx)
    args.update(over)
    return lambda: triton_int4.gptq_gemm(**args)


@pytest.mark.parametrize(
    "call,exc,field",
    [
        (_awq(group_size=48), ValueError, "group_size"),
        (_awq(qweight=torch.zeros(64, 3, dtype=torch.int32)), ValueError, "qweight"),
        (_awq(qzeros=torch.zeros(2, 2)), TypeError, "qzeros"),
        (_awq(x=torch.zeros(2, 64, dtype=torch.int32)), TypeError, "x must be"),
        (_gptq(bits=3), ValueError, "bits"),
        (_gptq(g_idx=torch.zeros(10, dtype=torch.int32)), ValueError, "g_idx"),
        (_gptq(g_idx=None), ValueError, "group_size"),
        (_gptq(checkpoint_format="gptq_v3"), ValueError, "checkpoint_format"),
    ],
)
def test_int4_kernels_refuse_bad_input_naming_the_field(call, exc, field):
    with pytest.raises(exc, match=field):
        call()


def test_oracle_packing_pins_the_published_nibble_orders():
    # Columns (AWQ) or rows (GPTQ) holding 0..7: AWQ interleaves them as [0, 2, 4, 6, 1, 3, 5, 7], GPTQ keeps them.
    vals = torch.arange(8).view(1, 8)
    assert oracle.pack_awq(vals).item() == 0x75316420
    assert oracle.pack_gptq_rows(vals.T, 4).item() == 0x76543210
    assert oracle.pack_gptq_cols(vals, 4).item() == 0x76543210
    assert oracle.pack_awq(vals).item() == packing.pack_cols(vals, packing.AWQ_ORDER).item()


@pytest.mark.parametrize("fmt,desc_act", [("awq", False), ("gptq", False), ("gptq", True), ("gptq_v2", True)])
def test_oracle_and_quantization_reference_agree_bit_for_bit(fmt, desc_act):
    # Two independent readings of the formats (this oracle, vllm_lite.quantization.packing) decode alike.
    for dtype in (torch.float16, torch.bfloat16):
        if fmt == "awq":
            q = oracle.random_awq_case(1, 128, 32, 64, dtype)
            ours = oracle.dequantize_awq_ref(q.qweight, q.qzeros, q.scales, 64)
            ref = packing.dequantize_awq(q.qweight, q.qzeros, q.scales, 64, dtype=dtype)
        else:
            zero_offset = 1 if fmt == "gptq" else 0
            q = oracle.random_gptq_case(1, 128, 32, 32, dtype, desc_act=desc_act, zero_offset=zero_offset)
            ours = oracle.dequantize_gptq_ref(q.qweight, q.qzeros, q.scales, q.g_idx, zero_offset=zero_offset)
            ref = packing.dequantize_gptq(q.qweight, q.qzeros, q.scales, q.g_idx, fmt, dtype=dtype)
        assert torch.equal(ours, ref) and torch.equal(ours.double(), q.weight)


def test_sorting_act_order_rows_keeps_each_row_and_makes_groups_contiguous():
    q = oracle.random_gptq_case(1, 256, 16, 64, torch.float16, desc_act=True)
    qweight, perm = triton_int4.sort_gptq_act_order(q.qweight, q.g_idx, 4)
    assert torch.equal(q.g_idx[perm].long(), torch.arange(256) // 64), "rows must come out in group order"
    plain = packing.dequantize_gptq(qweight, q.qzeros, q.scales, None, dtype=torch.float16)
    original = packing.dequantize_gptq(q.qweight, q.qzeros, q.scales, q.g_idx, dtype=torch.float16)
    assert torch.equal(plain, original[perm])
    uneven = q.g_idx.clone()
    uneven[0] = (uneven[0] + 1) % 4  # one group one row short, another one long
    assert triton_int4.sort_gptq_act_order(q.qweight, uneven, 4) is None
