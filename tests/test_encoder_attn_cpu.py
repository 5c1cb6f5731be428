"""csrc's encoder_attention_cpu (torch.ops.vllm_lite.encoder_attention_cpu) against a float64 per-prompt reference.

The kernel runs BERT's bidirectional attention for a whole packed batch in one call: every row must attend to
exactly the rows of its own prompt (any lengths, prompts longer than one work item's query chunk included),
q/k/v may be the strided column blocks of a fused qkv output, head sizes off the vector width must still be
right, results must not depend on the thread count, and bad inputs must raise before any data is read.
bert.encoder_attention must send float32 CPU batches to it and fall back to torch's per-prompt path without it.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.paged import make_attention_metadata
from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops
from vllm_lite.worker.models import bert

pytestmark = pytest.mark.skipif(
    not load_cpu_ops() or not hasattr(torch.ops.vllm_lite, "encoder_attention_cpu"),
    reason="vllm-lite's CPU kernels are not built here (no compiler)",
)

# 1 (a lone token), odd lengths off the vector width (a partial block of query lanes) and ending in every tail of
# the score tile's keys (12 at a time on AVX-512, 8 on AVX2, then 8/4/2/1), 300 over two of a work item's 256-row
# query chunks.
LENS = [1, 7, 16, 17, 33, 64, 65, 130, 3, 300]


def _op():
    return torch.ops.vllm_lite.encoder_attention_cpu


def _qkv(lens: list[int], heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as [T, H, D] views of one fused [T, 3*H*D] projection output (row stride 3*H*D, as BERT's)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    fused = torch.randn(t, 3 * heads * dim, generator=g)
    q, k, v = (x.view(t, heads, dim) for x in fused.split(heads * dim, -1))
    return q, k, v


def _cu(lens: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0).to(dtype)


def _reference(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start : start + n].double().transpose(0, 1) for x in (q, k, v))
        probs = (qs @ ks.transpose(1, 2) * scale).softmax(-1)
        outs.append((probs @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs).float()


@pytest.mark.parametrize("heads,dim", [(12, 32), (4, 64), (2, 16), (3, 40), (2, 8), (1, 128)])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_kernel_matches_float64_reference(heads: int, dim: int, cu_dtype: torch.dtype) -> None:
    q, k, v = _qkv(LENS, heads, dim)
    assert q.stride(0) == 3 * heads * dim  # strided views, as the model passes them
    got = _op()(q, k, v, _cu(LENS, cu_dtype), dim**-0.5)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, _reference(q, k, v, LENS, dim**-0.5), atol=2e-6, rtol=0)


def test_large_scores_stay_finite_and_exact() -> None:
    """Scores in the hundreds (softmax saturating to one key) must neither overflow nor lose the max. (A float32
    score of ~300 is itself only good to ~3e-5, so the tolerance is wider than at ordinary scales.)"""
    q, k, v = _qkv(LENS, 4, 32, seed=1)
    q = q * 30.0
    got = _op()(q, k, v, _cu(LENS), 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(q, k, v, LENS, 1.0), atol=2e-4, rtol=0)


def test_each_prompt_attends_only_to_its_own_rows() -> None:
    q, k, v = _qkv(LENS, 4, 32)
    before = _op()(q, k, v, _cu(LENS), 0.2)
    s, e = sum(LENS[:5]), sum(LENS[:6])  # the 64-token prompt
    k2, v2 = k.clone(), v.clone()
    k2[s:e] += 1.0
    v2[s:e] -= 2.0
    after = _op()(q, k2, v2, _cu(LENS), 0.2)
    assert torch.equal(before[:s], after[:s]) and torch.equal(before[e:], after[e:])
    assert not torch.allclose(before[s:e], after[s:e])


def test_kernel_is_thread_count_independent() -> None:
    q, k, v = _qkv(LENS * 4, 12, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _op()(q, k, v, _cu(LENS * 4), 0.17)
        torch.set_num_threads(max(2, threads))
        many = _op()(q, k, v, _cu(LENS * 4), 0.17)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_an_empty_batch_returns_an_empty_tensor() -> None:
    q = torch.empty(0, 2, 16)
    assert _op()(q, q, q, torch.zeros(1, dtype=torch.int32), 0.25).shape == (0, 2, 16)


def _bad_cases():
    q, k, v = _qkv([3, 4], 2, 16)
    cu = _cu([3, 4])
    return {
        "bfloat16": ((q.bfloat16(), k.bfloat16(), v.bfloat16(), cu), "dtype"),
        "2-D q": ((q.reshape(7, 32), k, v, cu), "dimensions"),
        "shape": ((q, k[:6], v, cu), "same shape"),
        "head_dim stride": ((q, k, v.transpose(1, 2), cu), "unit stride"),
        "cu dtype": ((q, k, v, cu.float()), "int32 or int64"),
        "cu start": ((q, k, v, torch.tensor([1, 3, 7], dtype=torch.int32)), "not 0"),
        "cu end": ((q, k, v, torch.tensor([0, 3, 6], dtype=torch.int32)), "rows"),
        "cu decreasing": ((q, k, v, torch.tensor([0, 5, 3, 7], dtype=torch.int32)), "decreases"),
        "cu empty": ((q, k, v, torch.zeros(0, dtype=torch.int32)), "at least one"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_kernel_rejects_bad_inputs(case: str) -> None:
    args, match = _bad_cases()[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        _op()(*args, 0.25)


@pytest.fixture
def restore_op():
    saved = list(bert._ENCODER_ATTN_OP)
    yield
    bert._ENCODER_ATTN_OP[:] = saved


def test_encoder_attention_takes_the_kernel_for_float32_cpu_and_torch_without_it(restore_op) -> None:
    lens = [5, 70, 1, 140]
    md = make_attention_metadata(lens, lens, [[0]] * len(lens), 1024)
    batch = bert.EncoderBatch.from_metadata(md, torch.device("cpu"))
    q, k, v = _qkv(lens, 12, 32)
    calls = []

    def spy(*args):
        calls.append(args)
        return _op()(*args)

    bert.set_encoder_attention_op(spy)
    got = bert.encoder_attention(q, k, v, batch, 0.2)
    assert len(calls) == 1 and torch.equal(calls[0][3], md.query_start_loc_cpu[: len(lens) + 1])
    bert.encoder_attention(q.double(), k.double(), v.double(), batch, 0.2)  # not float32: torch's path
    assert len(calls) == 1
    bert.set_encoder_attention_op(None)
    want = bert.encoder_attention(q, k, v, batch, 0.2)  # torch's per-prompt path
    assert len(calls) == 1
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_the_switch_turns_the_kernel_off(restore_op, monkeypatch) -> None:
    bert._ENCODER_ATTN_OP.clear()
    monkeypatch.setenv("VLLM_LITE_CPU_ENCODER_ATTN", "0")
    assert bert.encoder_attention_op() is None
    bert._ENCODER_ATTN_OP.clear()
    monkeypatch.setenv("VLLM_LITE_CPU_ENCODER_ATTN", "1")
    assert bert.encoder_attention_op() is not None
