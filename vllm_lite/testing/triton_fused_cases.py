"""Checks of the fused Triton layer kernels (vllm_lite/worker/models/triton_fused.py) against the torch code they
replace, shared by the CPU interpreter run and the compiled CUDA run.

Triton picks its interpreter when a kernel is decorated, so the CPU checks run in a process whose environment
had TRITON_INTERPRET=1 from the start: `python -m vllm_lite.testing.triton_fused_cases --device cpu` prints one
JSON line (check name -> null or the failure text). On CUDA the same checks run in-process, compiled.

References are the layers' torch code (the fallback in layers.py / gemma2.py, run on CPU with the C++ ops
off): interpreted, bfloat16 results must be equal bit for bit (the kernels round where torch rounds; the rotary
also compiled); float32 within FLOAT32_TOL (only the order of float32 operations differs: the sum of squares,
fused multiply-adds, and on CUDA the fast exp/rsqrt, which may also move a compiled bf16 norm or activation by
one rounding step). The GELU-tanh differs from torch's by design where tanh(u) ~ -1 (see check_act_and_mul).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from vllm_lite import envs
from vllm_lite.testing.triton_interpreter import run_named_checks

FLOAT32_TOL = 2e-6  # relative to the reference's largest magnitude
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_ARCHS = ("llama", "qwen3", "phi3", "phi3_longrope", "gemma2", "gemma3")


@contextlib.contextmanager
def torch_reference() -> Iterator[None]:
    """Within: the layers run their plain torch code on CPU (the C++ fused ops off, the Triton path off)."""
    from vllm_lite.worker.models import layers

    saved = list(layers._fused_state)
    layers._fused_state[:] = [None]
    try:
        yield
    finally:
        layers._fused_state[:] = saved


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str, exact_bf16: bool = True) -> None:
    """float32 within FLOAT32_TOL; bf16 equal, or with exact_bf16=False within one rounding step (compiled on
    CUDA a reduction's order, rsqrt and exp differ from the CPU reference's in the last float32 bits, which can move
    a bf16 rounding)."""
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}"
    if want.dtype == torch.float32:
        scale = max(want.abs().max().item(), 1.0)
        err = (got - want).abs().max().item()
        assert err <= FLOAT32_TOL * scale, f"{what}: max abs error {err} (scale {scale})"
    elif exact_bf16:
        bad = (got.float() != want.float()).sum().item()
        diff = (got.float() - want.float()).abs().max()
        assert bad == 0, f"{what}: {bad} of {want.numel()} elements differ; max {diff}"
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=2**-7, msg=lambda m: f"{what}: {m}")


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------- kernel checks


def check_rms_norm(device: str, dtype: torch.dtype, hidden: int, rows: int, residual: bool, gemma: bool) -> None:
    from vllm_lite.worker.models import triton_fused
    from vllm_lite.worker.models.gemma2 import GemmaRMSNorm
    from vllm_lite.worker.models.layers import RMSNorm

    x = _rand((rows, hidden), dtype, hidden + rows, 3.0)
    r = _rand((rows, hidden), dtype, hidden + rows + 1, 3.0) if residual else None
    norm = GemmaRMSNorm(hidden, 1e-5) if gemma else RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(_rand((hidden,), torch.float32, 7, 0.3) + (0.0 if gemma else 1.0))
    norm = norm.to(dtype)
    with torch_reference(), torch.no_grad():
        if residual and gemma:  # GemmaRMSNorm has no residual argument: the add in the activation dtype, then it
            want_r = x + r
            want_y = norm(want_r)
        elif residual:
            want_y, want_r = norm(x, r)
        else:
            want_y, want_r = norm(x), None
    xd, rd, w = x.to(device), (r.to(device) if residual else None), norm.weight.data.to(device)
    x_before = xd.clone()
    y, new_r = triton_fused.rms_norm(xd, w, 1e-5, rd, gemma=gemma)
    assert_matches(y, want_y, "y", device == "cpu")
    if residual:
        assert torch.equal(new_r.cpu(), want_r), "the new residual is not x + residual in the input dtype"
        assert torch.equal(rd.cpu(), r), "the residual argument changed"
    else:
        assert new_r is None
    assert torch.equal(xd, x_before), "x changed"


def check_gemma_norm_post_add(device: str, dtype: torch.dtype, hidden: int) -> None:
    """Gemma 2's sandwich: hidden + post_norm(out), the norm rounded before the add, in one kernel."""
    from vllm_lite.worker.models import triton_fused
    from vllm_lite.worker.models.gemma2 import GemmaRMSNorm

    x, h = _rand((4, hidden), dtype, 21, 3.0), _rand((4, hidden), dtype, 22, 3.0)
    norm = GemmaRMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(_rand((hidden,), torch.float32, 23, 0.3))
    norm = norm.to(dtype)
    with torch_reference(), torch.no_grad():
        want = h + norm(x)
        assert torch.equal(norm(x, add=h), want)  # the layer's torch fallback
    assert triton_fused.rms_norm_supported(x.to(device), norm.weight.to(device), h.to(device))
    got, none = triton_fused.rms_norm(x.to(device), norm.weight.data.to(device), 1e-6, gemma=True, add=h.to(device))
    assert none is None
    assert_matches(got, want, "post-add", device == "cpu")


def check_rms_norm_per_head(device: str, dtype: torch.dtype) -> None:
    """Qwen3 / Gemma 3's q norm: a [T, H, D] view of strided qkv rows (norm_per_head)."""
    from vllm_lite.worker.models import triton_fused
    from vllm_lite.worker.models.layers import RMSNorm, norm_per_head

    t, heads, d = 5, 3, 24
    qkv = _rand((t, (heads + 4) * d), dtype, 3)
    q = qkv[:, : heads * d]
    norm = RMSNorm(d, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(_rand((d,), torch.float32, 4, 0.3) + 1.0)
    norm = norm.to(dtype)
    with torch_reference(), torch.no_grad():
        want = norm_per_head(norm, q, heads, d)
    qd = qkv.to(device)[:, : heads * d].reshape(t, heads, d)
    assert triton_fused.rms_norm_supported(qd, norm.weight.to(device))
    y, _ = triton_fused.rms_norm(qd, norm.weight.data.to(device), 1e-6)
    assert_matches(y.view(t, -1), want, "per-head norm", device == "cpu")


def check_act_and_mul(device: str, dtype: torch.dtype, act: str, d: int, rows: int) -> None:
    from vllm_lite.worker.models import triton_fused
    from vllm_lite.worker.models.layers import SiluAndMul

    x = _rand((rows, 2 * d), dtype, d + rows, 4.0)
    with torch_reference(), torch.no_grad():
        if act == "silu":
            want = SiluAndMul()(x)
        else:
            want = F.gelu(x[:, :d], approximate="tanh") * x[:, d:]
    got = triton_fused.act_and_mul(x.to(device), act)
    if act == "gelu_tanh" and dtype != torch.float32:
        # torch's 0.5 * x * (1 + tanh(u)) cancels where tanh(u) ~ -1; the kernel's x * sigmoid(2u) does not, so
        # a bf16 result may sit one rounding step away from torch's.
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=2**-7)
        return
    assert_matches(got, want, act, device == "cpu")


def _rope(head_dim: int, partial: float, max_position: int = 512):
    from vllm_lite.worker.models.layers import RotaryEmbedding

    params = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": partial}
    return RotaryEmbedding(head_dim, max_position, params)


def _qkv(t: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    qkv = _rand((t, (heads + 2 * kv_heads) * head_dim), dtype, seed)
    return qkv, qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)


def check_rotary(device: str, dtype: torch.dtype, head_dim: int, partial: float) -> None:
    """q and k as QKVLinear.split views of one qkv row, rotated in place; v untouched."""
    from vllm_lite.worker.models import triton_fused

    t, heads, kv_heads = 7, 6, 2
    rope = _rope(head_dim, partial)
    qkv, (q, k, v) = _qkv(t, heads, kv_heads, head_dim, dtype, head_dim)
    positions = torch.tensor([0, 1, 5, 64, 300, 511, 2])
    with torch_reference(), torch.no_grad():
        want_q, want_k = rope(positions, q.clone(), k.clone())
    qkv_d = qkv.to(device)
    qd, kd, vd = qkv_d.split([q.shape[1], k.shape[1], v.shape[1]], dim=-1)
    table = rope.cos_sin_cache.to(device)
    assert triton_fused.rotary_supported(positions.to(device), qd, kd, table, head_dim, rope.rotary_dim)
    got_q, got_k = triton_fused.rotary(positions.to(device), qd, kd, table, head_dim, rope.rotary_dim)
    assert got_q.data_ptr() == qd.data_ptr() and got_k.data_ptr() == kd.data_ptr(), "not in place"
    assert_matches(got_q, want_q, "q")
    assert_matches(got_k, want_k, "k")
    assert torch.equal(vd.cpu(), v), "v changed"


def check_rotary_write_kv(device: str, dtype: torch.dtype, head_dim: int, partial: float) -> None:
    """Rotated k and v land at their slots (a negative slot writes nothing), q rotated in place, k untouched."""
    from vllm_lite.worker.attention.torch_ref import TorchRefBackend
    from vllm_lite.worker.models import triton_fused

    t, heads, kv_heads, block_size, blocks = 6, 4, 2, 4, 5
    rope = _rope(head_dim, partial)
    qkv, (q, k, v) = _qkv(t, heads, kv_heads, head_dim, dtype, 11 + head_dim)
    positions = torch.tensor([3, 0, 17, 200, 9, 0], dtype=torch.int32)
    slots = torch.tensor([5, 0, 19, 7, -1, 12])  # token 4 is padding
    cache = _rand((2, blocks, block_size, kv_heads, head_dim), dtype, 5)
    with torch_reference(), torch.no_grad():
        want_q, want_k = rope(positions.long(), q.clone(), k.clone())
        want_cache = cache.clone()
        keep = slots >= 0
        TorchRefBackend().write_kv(
            want_k[keep].view(-1, kv_heads, head_dim), v[keep].view(-1, kv_heads, head_dim), want_cache, slots[keep]
        )
    qkv_d, cache_d = qkv.to(device), cache.to(device)
    qd, kd, vd = qkv_d.split([q.shape[1], k.shape[1], v.shape[1]], dim=-1)
    table, pos_d, slots_d = rope.cos_sin_cache.to(device), positions.to(device), slots.to(device)
    assert triton_fused.rotary_write_kv_supported(kd, vd, cache_d, slots_d)
    triton_fused.rotary_write_kv(pos_d, qd, kd, vd, table, head_dim, rope.rotary_dim, cache_d, slots_d)
    assert_matches(qd, want_q, "q")
    assert torch.equal(kd.cpu(), k), "k changed (the rotated k goes to the cache only)"
    assert torch.equal(vd.cpu(), v), "v changed"
    assert_matches(cache_d, want_cache, "kv cache")


def check_dispatch(device: str) -> None:
    """The layers pick the Triton path on this device (and under autograd the torch code)."""
    from vllm_lite.worker.models.layers import fused_kernel_path, triton_on_cpu_under_interpreter

    if device == "cpu":  # interpreted: CPU tensors take the kernels only inside triton_on_cpu_under_interpreter()
        assert fused_kernel_path(device, torch.bfloat16) != "triton"
        with triton_on_cpu_under_interpreter():
            check_dispatch("cuda")  # asking about CUDA needs no GPU
            assert fused_kernel_path(device, torch.bfloat16) == "triton"
        assert fused_kernel_path(device, torch.bfloat16) != "triton"
        return
    assert fused_kernel_path(device, torch.bfloat16) == "triton"
    assert fused_kernel_path(device, torch.float32) == "triton"
    assert fused_kernel_path(device, torch.bfloat16, grad=True) == "torch"


# ---------------------------------------------------------------------------- whole models


@contextlib.contextmanager
def _counting_calls(calls: dict[str, int]) -> Iterator[None]:
    """Count the calls of triton_fused's entry points (the layers call them as module attributes)."""
    from vllm_lite.worker.models import triton_fused

    names = ("rms_norm", "act_and_mul", "rotary", "rotary_write_kv")
    saved = {n: getattr(triton_fused, n) for n in names}

    def counted(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    for n in names:
        setattr(triton_fused, n, counted(n, saved[n]))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(triton_fused, n, fn)


def _tiny_model(arch: str):
    from vllm_lite.testing.checkpoints import _hf_config, _randomize
    from vllm_lite.worker.models.registry import get_model_class

    config = _hf_config(arch, "tiny", 97, None)
    torch.manual_seed(0)
    model = get_model_class(config.architectures)(config)
    _randomize(model, 0.1, 0)
    return model.eval()


def _run_model(model, backend, device: str, caches: list[torch.Tensor], md, input_ids, positions) -> torch.Tensor:
    from vllm_lite.worker.attention.layer import Attention
    from vllm_lite.worker.forward_context import set_forward_context

    attns = [m for m in model.modules() if isinstance(m, Attention)]
    for attn, cache in zip(attns, caches):
        attn.kv_cache = cache
    with torch.no_grad(), set_forward_context(md, backend):
        return model(input_ids.to(device), positions.to(device))


def check_model(device: str, arch: str) -> None:
    """A tiny model's step (a prefill chunk and two decodes, over cached context) through the Triton path equals
    the torch path's: hidden states and every layer's KV cache. Every fused kernel must have run."""
    from vllm_lite.testing.attention_oracle import random_attention_case
    from vllm_lite.worker.attention.layer import Attention
    from vllm_lite.worker.attention.torch_ref import TorchRefBackend
    from vllm_lite.worker.attention.triton_attn import TritonBackend
    from vllm_lite.worker.models.layers import triton_on_cpu_under_interpreter

    model = _tiny_model(arch)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    query_lens, seq_lens = [3, 1, 1], [8, 40, 5]
    layers_n = sum(isinstance(m, Attention) for m in model.modules())
    _, cache0, md = random_attention_case(query_lens, seq_lens, 1, attn.num_kv_heads, attn.head_size, 4, torch.float32)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (md.num_actual_tokens,), generator=g)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    caches_ref = [cache0 * (0.5 + i) for i in range(layers_n)]
    caches = [c.to(device, copy=True) for c in caches_ref]
    with torch_reference():
        want = _run_model(model, TorchRefBackend(), "cpu", caches_ref, md, input_ids, positions)

    model = model.to(device)
    md_d = _metadata_to(md, device)
    calls: dict[str, int] = {}
    ctx = triton_on_cpu_under_interpreter() if device == "cpu" else contextlib.nullcontext()
    with ctx, _counting_calls(calls):
        got = _run_model(model, TritonBackend(), device, caches, md_d, input_ids, positions)
    scale = max(want.abs().max().item(), 1.0)
    err = (got.cpu() - want).abs().max().item()
    tol = 1e-5 if device == "cpu" else 1e-4  # compiled: another GEMM accumulation order too
    assert err <= tol * scale, f"{arch}: hidden states differ by {err} (scale {scale})"
    for i, (c, r) in enumerate(zip(caches, caches_ref)):
        err = (c.cpu() - r).abs().max().item()
        assert err <= tol * max(r.abs().max().item(), 1.0), f"{arch}: layer {i}'s KV cache differs by {err}"
    assert calls.get("rotary_write_kv") == layers_n, f"{arch}: fused rotary + KV write ran {calls}"
    assert calls.get("rms_norm", 0) >= 2 * layers_n, f"{arch}: fused RMSNorm calls {calls}"
    assert calls.get("act_and_mul") == layers_n, f"{arch}: fused act-and-mul calls {calls}"


def _metadata_to(md, device: str):
    from dataclasses import replace

    return replace(
        md,
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        block_table=md.block_table.to(device),
        slot_mapping=md.slot_mapping.to(device),
        num_tokens=None if md.num_tokens is None else md.num_tokens.to(device),
    )


# ---------------------------------------------------------------------------- registry


def all_checks(device: str) -> dict[str, Callable[[], None]]:
    """Every check by name, bound to a device."""
    checks: dict[str, Callable[[], None]] = {}
    for dname, dtype in DTYPES.items():
        for hidden, rows in ((300, 3), (2048, 5), (64, 1)):
            for residual in (False, True):
                for gemma in (False, True):
                    name = f"rms_norm-{dname}-h{hidden}-r{rows}-{'res' if residual else 'plain'}-{'gemma' if gemma else 'w'}"
                    checks[name] = lambda a=(device, dtype, hidden, rows, residual, gemma): check_rms_norm(*a)
        checks[f"gemma_norm_post_add-{dname}"] = lambda dtype=dtype: check_gemma_norm_post_add(device, dtype, 300)
        checks[f"rms_norm_per_head-{dname}"] = lambda dtype=dtype: check_rms_norm_per_head(device, dtype)
        for act in ("silu", "gelu_tanh"):
            for d, rows in ((37, 3), (1500, 2)):
                checks[f"{act}_and_mul-{dname}-d{d}"] = lambda a=(device, dtype, act, d, rows): check_act_and_mul(*a)
        for head_dim, partial in ((64, 1.0), (48, 0.5), (80, 1.0)):
            checks[f"rotary-{dname}-d{head_dim}-p{partial}"] = lambda a=(device, dtype, head_dim, partial): (
                check_rotary(*a)
            )
            checks[f"rotary_write_kv-{dname}-d{head_dim}-p{partial}"] = lambda a=(device, dtype, head_dim, partial): (
                check_rotary_write_kv(*a)
            )
    checks["dispatch"] = lambda: check_dispatch(device)
    for arch in MODEL_ARCHS:
        checks[f"model-{arch}"] = lambda arch=arch: check_model(device, arch)
    return checks


def run_checks(device: str, only: Optional[str] = None) -> dict[str, Optional[str]]:
    """Run every check (or those whose name contains `only`); name -> None when it passed, else its failure."""
    return run_named_checks({name: check for name, check in all_checks(device).items() if not only or only in name})


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", default=None, help="run the checks whose name contains this")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not envs.TRITON_INTERPRET:
        parser.error("--device cpu needs TRITON_INTERPRET=1 in this process's environment")
    results = run_checks(args.device, args.only)
    print(json.dumps({"device": args.device, "results": results}))
    return 0 if all(v is None for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
