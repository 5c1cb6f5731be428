"""The CUDA LoRA delta of a BGMV step (triton_ops.add_lora_bgmv) in one launch or two. One (the fused kernel, steps
of at most FUSED_MAX_TOKENS tokens): each (token, output tile) program computes its token's shrink itself and adds
B @ h into its tile. Two (larger steps): the shrink stores split-K partial sums into an uninitialised buffer, one
expand sums them and writes every sub-projection (q|k|v, gate|up, or one).

Checked in the Triton interpreter on CPU (a subprocess of this file with TRITON_INTERPRET=1 in its environment
only): float64 reference per token, the old path (zeroed buffer, atomics, lora_expand per sub) to float32
rounding, rows without an adapter and columns outside the subs untouched, a NaN-filled "uninitialised" buffer
never read, and the fallbacks (False, nothing written) where neither path applies. The fused kernel the same way
over dtypes, ranks (padded ones too), sub layouts, tiles and slot patterns (none, one, round robin, padded rows),
and which kernels a step launches on each side of FUSED_MAX_TOKENS and FUSED_MAX_RANK. Compiled for sm_90
without a GPU (no atomics). On CUDA (test_compiled_*_cuda*): both paths against the reference at the 100M
Qwen2's shapes, and inside a captured CUDA graph replayed with other slots.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from typing import Optional

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("package 'triton' is not installed (pip install 'vllm-lite[triton]')", allow_module_level=True)

from vllm_lite.lora import ops, triton_ops  # noqa: E402
from vllm_lite.testing.devices import requires_cuda_devices  # noqa: E402
from vllm_lite.testing.triton_interpreter import compile_for_sm90  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (subs' output sizes, tokens, split_k or None (the size-based split), dtype, rank, hidden)
# (The shrink's K tile is 128 wide from hidden 128 up: a split of s has partials 1..s-1 only past s * 128 - 128.)
INTERPRETER_CASES = {
    "qkv-f32-auto": ([48, 16, 16], 7, None, torch.float32, 8, 512),  # split 4
    "gate_up-bf16-split3": ([32, 32], 5, 3, torch.bfloat16, 8, 400),
    "one-sub-f16-split2": ([40], 4, 2, torch.float16, 16, 300),
    "qkv-tile16-f32-split1": ([64, 32, 16], 9, 1, torch.float32, 8, 48),
}
# The fused kernel: (subs' output sizes, tokens, dtype, rank, hidden, tiles (add_lora_bgmv's block_n /
# block_k), slot pattern (see _inputs), real rank (None: every rank row used; else the adapters' rank, the rest of
# the layer's max rank zero as LoRALinear pads it)).
FUSED_CASES = {
    "qkv-f32-r8-default-tiles": ([48, 16, 16], 7, torch.float32, 8, 200, {}, "random", None),
    "qkv-bf16-r16-n32-k64": ([64, 32, 32], 6, torch.bfloat16, 16, 300, dict(block_n=32, block_k=64), "rr", None),
    "gate_up-bf16-r12-n64": ([64, 64], 5, torch.bfloat16, 12, 256, dict(block_n=64), "padded", None),
    "gate_up-f16-r16-padded-rank": ([32, 32], 4, torch.float16, 16, 96, dict(block_k=32), "random", 5),
    "one-sub-f32-r32-tile-past-the-end": ([40], 4, torch.float32, 32, 100, dict(block_n=64), "random", None),
    "one-sub-bf16-r4-k16-many-tiles": ([48], 3, torch.bfloat16, 4, 40, dict(block_n=16, block_k=16), "one", None),
    "qkv-bf16-r64-no-adapter": ([32, 16, 16], 3, torch.bfloat16, 64, 64, {}, "none", None),
    "qkv-f32-lone-token": ([48, 16, 16], 1, torch.float32, 16, 128, dict(block_n=16), "random", None),
}
CUDA_CASES = {  # the 100M Qwen2 (hidden 768, 12 heads, 4 KV heads, intermediate 3072), rank 16, and a 4096 model
    f"{name}-{dtype_name}-t{t}-{'fused' if fused else 'two'}": (outs, t, None, dtype, 16, hidden, fused)
    for name, outs, hidden in (
        ("qkv", [768, 256, 256], 768),
        ("gate_up", [3072, 3072], 768),
        ("down", [768], 3072),
        ("qkv4096", [4096, 1024, 1024], 4096),
    )
    for dtype_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16))
    for t in (1, 16, 17, 300)
    for fused in (True, False)
    if not (fused and t > 64)
}


def _inputs(
    outs: list[int],
    tokens: int,
    dtype: torch.dtype,
    rank: int,
    hidden: int,
    device: str,
    seed: int = 0,
    pattern: str = "random",
    real_rank: Optional[int] = None,
):
    """Random A/B/x/y and slots of 4 adapters. pattern "random": slots -1..4 (4: past the table), token 0 without
    an adapter (a lone token: with), token 1 slot 2; "rr": t % 4; "one": all slot 3; "none": all -1; "padded": a
    CUDA graph's padding, the first half round robin and the rest -1."""
    g = torch.Generator().manual_seed(seed)
    slots_total = 4
    lora_a = (torch.randn(slots_total, len(outs) * rank, hidden, generator=g) / hidden**0.5).to(dtype)
    lora_b = [(torch.randn(slots_total, o, rank, generator=g) / rank**0.5).to(dtype) for o in outs]
    if real_rank is not None:  # rows/columns past the adapters' rank are zero, as LoRALinear.set_slot leaves them
        for i, b in enumerate(lora_b):
            lora_a[:, i * rank + real_rank : (i + 1) * rank] = 0
            b[:, :, real_rank:] = 0
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    if pattern == "random":
        slots = torch.randint(-1, slots_total + 1, (tokens,), generator=g, dtype=torch.int32)
        slots[0] = -1 if tokens > 1 else 2  # a token without an adapter, and one with (a lone token: with)
        if tokens > 1:
            slots[1] = 2
    else:
        ids = torch.arange(tokens, dtype=torch.int32)
        slots = {
            "rr": ids % slots_total,
            "one": torch.full_like(ids, 3),
            "none": torch.full_like(ids, -1),
            "padded": torch.where(ids < (tokens + 1) // 2, ids % slots_total, -1),
        }[pattern]
    y0 = torch.randn(tokens, sum(outs) + 24, generator=g).to(dtype)
    offsets = [8 + sum(outs[:i]) for i in range(len(outs))]  # y's first 8 and last 16 columns belong to no sub
    dev = [t.to(device) for t in (lora_a, x, slots, y0)]
    return dev[0], [b.to(device) for b in lora_b], dev[1], dev[2], dev[3], offsets


def _reference(y0, x, lora_a, lora_b, slots, offsets) -> torch.Tensor:
    """float64 per token: buf = A x (float32 accumulation, rounded to the weights' dtype), y += B buf per sub."""
    y = y0.double().cpu().clone()
    rank = lora_b[0].shape[2]
    a, bs, xs = lora_a.double().cpu(), [b.double().cpu() for b in lora_b], x.double().cpu()
    for t, s in enumerate(slots.tolist()):
        if not 0 <= s < a.shape[0]:
            continue
        h = (a[s] @ xs[t]).float().to(lora_b[0].dtype).double()
        for i, (b, off) in enumerate(zip(bs, offsets)):
            y[t, off : off + b.shape[1]] += b[s] @ h[i * rank : (i + 1) * rank]
    return y


def _old_path(y0, x, lora_a, lora_b, slots, offsets) -> torch.Tensor:
    """The launches before add_lora_bgmv: a zeroed buffer filled by atomics, then lora_expand per sub."""
    y = y0.clone()
    buf = triton_ops.lora_shrink(x, lora_a, slots)
    rank = lora_b[0].shape[2]
    for i, (b, off) in enumerate(zip(lora_b, offsets)):
        triton_ops.lora_expand(y, buf[:, i * rank : (i + 1) * rank], b, slots, off)
    return y


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> Optional[str]:
    out, expected = out.double().cpu(), expected.double().cpu()
    scale = max(float(expected.abs().max()), 1e-6)
    try:
        torch.testing.assert_close(out, expected, atol=TOL[dtype] * scale, rtol=TOL[dtype])
    except AssertionError as e:
        return f"{what}: {e}"
    return None


def check_case(
    case: tuple,
    device: str,
    nan_scratch: bool = False,
    fused: bool = False,
    tiles: Optional[dict] = None,
    pattern: str = "random",
    real_rank: Optional[int] = None,
) -> Optional[str]:
    """None if add_lora_bgmv (one launch when ``fused``, else two) takes the case and matches the reference and the
    old path, else what failed."""
    outs, tokens, split, dtype, rank, hidden = case[:6]
    lora_a, lora_b, x, slots, y0, offsets = _inputs(
        outs, tokens, dtype, rank, hidden, device, pattern=pattern, real_rank=real_rank
    )
    y = y0.clone()
    empty = torch.empty
    if nan_scratch:  # an "uninitialised" partial buffer full of NaN: any read of a row it did not write shows
        triton_ops.torch.empty = lambda *a, **k: empty(*a, **k).fill_(float("nan"))  # type: ignore[attr-defined]
    try:
        took = triton_ops.add_lora_bgmv(
            y, x, lora_a, lora_b, offsets, slots, split_k=split, fused=fused, **(tiles or {})
        )
    finally:
        triton_ops.torch.empty = empty  # type: ignore[attr-defined]
    if not took:
        return "add_lora_bgmv returned False"
    if not bool(torch.isfinite(y).all()):
        return "non-finite values in y"
    inside = torch.zeros(y.shape[1], dtype=torch.bool, device=y.device)
    inside[offsets[0] : offsets[-1] + outs[-1]] = True
    if not torch.equal(y[:, ~inside], y0[:, ~inside]):
        return "columns outside the subs changed"
    no_adapter = (slots < 0) | (slots >= lora_a.shape[0])
    if not torch.equal(y[no_adapter], y0[no_adapter]):
        return "rows without an adapter changed"
    return _close(y, _reference(y0, x, lora_a, lora_b, slots, offsets), dtype, "vs float64 reference") or _close(
        y, _old_path(y0, x, lora_a, lora_b, slots, offsets), dtype, "vs the old launches"
    )


def check_fallbacks(device: str) -> dict:
    """Where the two-launch path does not apply it returns False and leaves y alone: {case: taken or y changed}."""

    def taken(outs: list[int], offsets: Optional[list[int]] = None, subs_times: int = 1) -> bool:
        lora_a, lora_b, x, slots, y0, offs = _inputs(outs, 5, torch.float32, 8, 32, device)
        y = y0.clone()
        took = triton_ops.add_lora_bgmv(y, x, lora_a, lora_b * subs_times, offsets or offs, slots)
        return took or not torch.equal(y, y0)

    res = {
        "no 16-column tile divides the subs": taken([40, 24]),
        "subs not side by side": taken([32, 32], [0, 40]),
        "four subs": taken([32, 32], [0, 32, 64, 96], subs_times=2),
    }
    old = triton_ops.BGMV_MAX_TOKENS
    triton_ops.BGMV_MAX_TOKENS = 4  # 5 tokens: SGMV
    try:
        res["an SGMV step"] = taken([32, 32])
    finally:
        triton_ops.BGMV_MAX_TOKENS = old
    return res


def check_ops_route(device: str) -> dict:
    """ops.add_lora_triton takes add_lora_bgmv (never lora_shrink) where it applies, and the old launches elsewhere,
    with the same result as those launches."""
    res = {}
    shrink = triton_ops.lora_shrink
    calls = []

    def counting(*a, **k):
        calls.append(1)
        return shrink(*a, **k)

    triton_ops.lora_shrink = counting
    try:
        for name, outs in (("qkv", [32, 16, 16]), ("odd sizes", [40, 24])):
            lora_a, lora_b, x, slots, y0, offsets = _inputs(outs, 6, torch.float32, 8, 32, device)
            y = y0.clone()
            calls.clear()
            ops.add_lora_triton(triton_ops, y, x, lora_a, lora_b, offsets, slots)
            res[name] = {
                "shrink_calls": len(calls),
                "error": _close(y, _reference(y0, x, lora_a, lora_b, slots, offsets), torch.float32, name),
            }
    finally:
        triton_ops.lora_shrink = shrink
    return res


def check_fused_case(name: str, device: str) -> Optional[str]:
    outs, tokens, dtype, rank, hidden, tiles, pattern, real_rank = FUSED_CASES[name]
    case = (outs, tokens, None, dtype, rank, hidden)
    return check_case(case, device, fused=True, tiles=tiles, pattern=pattern, real_rank=real_rank)


class _Counting:
    """Stands in for a Triton kernel object: records its name on each launch (kernel[grid](...))."""

    def __init__(self, kernel, name: str, log: list) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


KERNELS = ("_bgmv_fused_kernel", "_bgmv_shrink_partials_kernel", "_bgmv_expand_partials_kernel", "_bgmv_kernel",
           "_bgmv_expand_subs_kernel", "_sgmv_kernel")  # fmt: skip


def check_fused_route(device: str) -> dict:
    """Which kernels one layer's delta launches (through ops.add_lora_triton, as a LoRA layer calls it) on either
    side of FUSED_MAX_TOKENS and FUSED_MAX_RANK, whether the fused path allocates anything, and the result's error
    against the reference each time."""
    log: list = []
    saved = {name: getattr(triton_ops, name) for name in KERNELS}
    limits = triton_ops.FUSED_MAX_TOKENS, triton_ops.FUSED_MAX_RANK
    res: dict = {}

    def run(tokens: int, rank: int, forbid_alloc: bool = False) -> dict:
        lora_a, lora_b, x, slots, y0, offsets = _inputs([32, 16, 16], tokens, torch.float32, rank, 40, device)
        y = y0.clone()
        log.clear()
        allocs = []
        saved_alloc = triton_ops.torch.empty, triton_ops.torch.zeros
        if forbid_alloc:
            triton_ops.torch.empty = lambda *a, **k: allocs.append("empty") or saved_alloc[0](*a, **k)
            triton_ops.torch.zeros = lambda *a, **k: allocs.append("zeros") or saved_alloc[1](*a, **k)
        try:
            ops.add_lora_triton(triton_ops, y, x, lora_a, lora_b, offsets, slots)
        finally:
            triton_ops.torch.empty, triton_ops.torch.zeros = saved_alloc
        error = _close(y, _reference(y0, x, lora_a, lora_b, slots, offsets), torch.float32, f"T={tokens} r={rank}")
        out = {"launches": list(log), "error": error}
        if forbid_alloc:
            out["allocations"] = allocs
        return out

    try:
        for name in KERNELS:
            setattr(triton_ops, name, _Counting(saved[name], name, log))
        triton_ops.FUSED_MAX_TOKENS, triton_ops.FUSED_MAX_RANK = 4, 16
        res["at the token limit"] = run(4, 8, forbid_alloc=True)
        res["past the token limit"] = run(5, 8)
        res["rank past the fused limit"] = run(3, 32)
        try:
            lora_a, lora_b, x, slots, y0, offsets = _inputs([32, 16, 16], 3, torch.float32, 32, 40, device)
            triton_ops.add_lora_bgmv(y0, x, lora_a, lora_b, offsets, slots, fused=True)
            res["fused forced past the rank limit"] = "no error"
        except ValueError as e:
            res["fused forced past the rank limit"] = str(e)
    finally:
        for name, kernel in saved.items():
            setattr(triton_ops, name, kernel)
        triton_ops.FUSED_MAX_TOKENS, triton_ops.FUSED_MAX_RANK = limits
    return res


def _interpreter_report() -> dict:
    return {
        "cases": {name: check_case(case, "cpu") for name, case in INTERPRETER_CASES.items()},
        "nan_scratch": check_case(INTERPRETER_CASES["qkv-f32-auto"], "cpu", nan_scratch=True),
        "fallbacks": check_fallbacks("cpu"),
        "route": check_ops_route("cpu"),
        "fused": {name: check_fused_case(name, "cpu") for name in FUSED_CASES},
        "fused_route": check_fused_route("cpu"),
    }


@pytest.fixture(scope="module")
def interpreted() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # vllm_lite importable from the script
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, __file__, "--interpret"], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the interpreter run printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", list(INTERPRETER_CASES))
def test_two_launch_bgmv_matches_reference_in_the_interpreter(interpreted: dict, name: str) -> None:
    assert interpreted["cases"][name] is None, interpreted["cases"][name]


def test_partial_buffer_rows_not_written_are_never_read_in_the_interpreter(interpreted: dict) -> None:
    assert interpreted["nan_scratch"] is None, interpreted["nan_scratch"]


def test_two_launch_bgmv_declines_where_it_does_not_apply_in_the_interpreter(interpreted: dict) -> None:
    assert not any(interpreted["fallbacks"].values()), interpreted["fallbacks"]


def test_ops_route_bgmv_steps_past_the_shrink_in_the_interpreter(interpreted: dict) -> None:
    route = interpreted["route"]
    assert route["qkv"] == {"shrink_calls": 0, "error": None}, route
    assert route["odd sizes"] == {"shrink_calls": 1, "error": None}, route


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_bgmv_matches_reference_in_the_interpreter(interpreted: dict, name: str) -> None:
    assert interpreted["fused"][name] is None, interpreted["fused"][name]


def test_fused_bgmv_takes_steps_up_to_the_token_limit_in_one_launch_in_the_interpreter(interpreted: dict) -> None:
    route = interpreted["fused_route"]
    at = route["at the token limit"]
    assert at == {"launches": ["_bgmv_fused_kernel"], "error": None, "allocations": []}, route


def test_two_launches_past_the_fused_limits_in_the_interpreter(interpreted: dict) -> None:
    route = interpreted["fused_route"]
    two = {"launches": ["_bgmv_shrink_partials_kernel", "_bgmv_expand_partials_kernel"], "error": None}
    assert route["past the token limit"] == two, route
    assert route["rank past the fused limit"] == two, route
    assert "ranks up to 16" in route["fused forced past the rank limit"], route


def test_uniform_tile_divides_every_sub_boundary() -> None:
    assert triton_ops._uniform_block_n([896, 128, 128]) == 64
    assert triton_ops._uniform_block_n([48, 16, 16]) == 16
    assert triton_ops._uniform_block_n([768]) == 64  # one sub: any tile
    assert triton_ops._uniform_block_n([40, 24]) is None
    assert triton_ops._uniform_block_n([768, 256, 256], 256) == 256  # the fused kernel's wider tiles
    assert triton_ops._uniform_block_n([896, 128, 128], 512) == 128
    assert triton_ops._uniform_block_n([3072, 3072], 512) == 512


# ------------------------------------------------------------------------ compiled for sm_90 without a GPU


def test_partials_shrink_compiles_for_sm90_without_atomics() -> None:
    sig = {"in_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "slots_ptr": "*i32"}
    for name in ("num_slots", "n_out", "k_in", "stride_in_t", "stride_w_s", "stride_w_n", "stride_out_s"):
        sig[name] = "i32"
    sig["stride_out_t"] = "i32"
    consts = dict(stride_in_k=1, stride_w_k=1, stride_out_n=1, SPLIT_K=4, BLOCK_N=64, BLOCK_K=128)
    compiled = compile_for_sm90(triton_ops._bgmv_shrink_partials_kernel, sig, consts)
    atomics = re.findall(r"^\s*(?:@%p\d+\s+)?(?:atom|red)\.\S*", compiled.asm["ptx"], re.M)
    assert compiled.asm["cubin"] and not atomics, atomics


@pytest.mark.parametrize("n_sub", [1, 3])
def test_partials_expand_compiles_for_sm90(n_sub: int) -> None:
    sig = {"in_ptr": "*fp32", "w0_ptr": "*bf16", "w1_ptr": "*bf16", "w2_ptr": "*bf16", "out_ptr": "*bf16"}
    sig["slots_ptr"] = "*i32"
    for name in ("num_slots", "n_out", "rank", "start1", "start2", "stride_in_s", "stride_in_t", "stride_w0_s"):
        sig[name] = "i32"
    for name in ("stride_w1_s", "stride_w2_s", "stride_w_n", "stride_out_t"):
        sig[name] = "i32"
    consts = dict(stride_in_k=1, stride_w_k=1, stride_out_n=1, SPLIT=4, SPLIT_PAD=4, N_SUB=n_sub, BLOCK_N=64)
    consts["BLOCK_K"] = 16
    compiled = compile_for_sm90(triton_ops._bgmv_expand_partials_kernel, sig, consts)
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("n_sub", [1, 2, 3])
def test_fused_kernel_compiles_for_sm90_without_atomics(n_sub: int) -> None:
    sig = {name: "*bf16" for name in ("x_ptr", "a_ptr", "w0_ptr", "w1_ptr", "w2_ptr", "out_ptr")}
    sig["slots_ptr"] = "*i32"
    for name in ("num_slots", "n_out", "k_in", "rank", "start1", "start2", "stride_x_t", "stride_a_s", "stride_a_r"):
        sig[name] = "i32"
    for name in ("stride_w0_s", "stride_w1_s", "stride_w2_s", "stride_w_n", "stride_out_t"):
        sig[name] = "i32"
    consts = dict(stride_x_k=1, stride_a_k=1, stride_w_k=1, stride_out_n=1, N_SUB=n_sub, BLOCK_N=256)
    consts.update(BLOCK_R=16, BLOCK_K=1024)
    compiled = compile_for_sm90(triton_ops._bgmv_fused_kernel, sig, consts)
    atomics = re.findall(r"^\s*(?:@%p\d+\s+)?(?:atom|red)\.\S*", compiled.asm["ptx"], re.M)
    assert compiled.asm["cubin"] and not atomics, atomics


# ------------------------------------------------------------------------ CUDA


@requires_cuda_devices(1)
@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_compiled_bgmv_on_cuda_matches_reference(name: str) -> None:
    case = CUDA_CASES[name]
    assert check_case(case, "cuda", fused=case[6]) is None


@requires_cuda_devices(1)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two"])
def test_compiled_bgmv_on_cuda_in_a_captured_graph(fused: bool) -> None:
    """Captured once (as a LoRA engine's decode graph holds it), replayed with other slots and inputs: equals the
    eager call each time and the float64 reference."""
    outs, tokens, dtype = [768, 256, 256], 16, torch.bfloat16
    lora_a, lora_b, x, slots, y0, offsets = _inputs(outs, tokens, dtype, 16, 768, "cuda")
    y = y0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        assert triton_ops.add_lora_bgmv(y, x, lora_a, lora_b, offsets, slots, fused=fused)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_ops.add_lora_bgmv(y, x, lora_a, lora_b, offsets, slots, fused=fused)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        slots.copy_(torch.randint(-1, 5, (tokens,), device="cuda", dtype=torch.int32, generator=g))
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(dtype))
        y.copy_(y0)
        graph.replay()
        eager = y0.clone()
        triton_ops.add_lora_bgmv(eager, x, lora_a, lora_b, offsets, slots, fused=fused)
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
        assert _close(y, _reference(y0, x, lora_a, lora_b, slots, offsets), dtype, "graph") is None


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--interpret"]:
        print(json.dumps(_interpreter_report()))
