"""Triton paged-attention and KV-writer kernels, run on CPU in the Triton interpreter (TRITON_INTERPRET=1).

Cases are small because the interpreter executes each program in Python. Tolerances: float32
1e-5; bfloat16 2e-2 (the kernel widens bf16 tiles to float32 in the interpreter, so only the
output rounding differs from the float64 oracle). On a CUDA machine the same kernels also run
natively against the oracle.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

# The interpreter is chosen when a kernel is decorated, so this must precede importing the backend.
os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("triton") is None:
    pytest.skip("package 'triton' is not installed (pip install 'vllm-lite[triton]')", allow_module_level=True)

from vllm_lite.testing.attention_oracle import random_attention_case, reference_paged_attention  # noqa: E402
from vllm_lite.worker.attention.selector import get_attn_backend  # noqa: E402
from vllm_lite.worker.attention.torch_ref import TorchRefBackend  # noqa: E402
from vllm_lite.worker.attention.triton_attn import TritonBackend  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Decode without context, decodes with context, a first prefill chunk, a later chunk with context.
QUERY_LENS = [1, 1, 5, 1, 9]
SEQ_LENS = [1, 40, 5, 70, 30]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


def _to(device: str, query, cache, md):
    if device == "cpu":
        return query, cache, md
    from dataclasses import replace

    md = replace(
        md,
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        block_table=md.block_table.to(device),
        slot_mapping=md.slot_mapping.to(device),
    )
    return query.to(device), cache.to(device), md


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,block_size,head_size,gqa",
    [
        (torch.float32, 16, 64, 1),
        (torch.float32, 1, 32, 2),
        (torch.float32, 32, 128, 4),
        (torch.float32, 16, 32, 3),
        (torch.bfloat16, 16, 64, 2),
        (torch.bfloat16, 32, 128, 1),
    ],
)
def test_triton_attention_mixed_batch_matches_oracle(device, dtype, block_size, head_size, gqa):
    query, cache, md = random_attention_case(QUERY_LENS, SEQ_LENS, 2 * gqa, 2, head_size, block_size, dtype)
    scale = 1.0 / math.sqrt(head_size)
    expected = reference_paged_attention(query, cache, md, scale)
    query, cache, md = _to(device, query, cache, md)
    out = TritonBackend(tile_n=16).forward(query, cache, md, scale)
    assert out.shape == query.shape and out.dtype == dtype
    _close(out, expected, dtype)


def test_triton_attention_long_prefill_uses_many_query_tiles_and_agrees_with_torch_ref():
    # 40 prefill tokens x 4 heads per KV head: BLOCK_M 64 -> 16 tokens per tile, 3 tiles.
    query, cache, md = random_attention_case([40, 1], [75, 50], 8, 2, 32, 16, torch.float32, seed=7)
    out = TritonBackend(tile_n=32).forward(query, cache, md, 0.2)
    _close(out, reference_paged_attention(query, cache, md, 0.2), torch.float32)
    _close(out, TorchRefBackend().forward(query, cache, md, 0.2), torch.float32)


def test_triton_write_kv_places_rows_exactly_and_skips_negative_slots():
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 4, 8, 2, 32, generator=g).to(torch.bfloat16)
    fused = torch.randn(4, 3 * 64, generator=g).to(torch.bfloat16)  # strided rows, like a qkv projection
    key, value = fused[:, 64:128].view(4, 2, 32), fused[:, 128:].view(4, 2, 32)
    slots = torch.tensor([3, -1, 31, 8])
    expected = cache.clone()
    keep = slots >= 0
    expected[0].view(-1, 2, 32)[slots[keep]] = key[keep]
    expected[1].view(-1, 2, 32)[slots[keep]] = value[keep]
    TritonBackend().write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_triton_backend_rejects_mismatched_heads():
    query, cache, md = random_attention_case([2], [4], 3, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        TritonBackend().forward(query, cache, md, 1.0)
    with pytest.raises(ValueError, match="tile_n"):
        TritonBackend(tile_n=24)


def test_selector_forces_triton_by_name_and_env(monkeypatch):
    assert isinstance(get_attn_backend(torch.device("cpu"), "triton"), TritonBackend)
    monkeypatch.setenv("VLLM_LITE_ATTENTION_BACKEND", "triton")
    assert isinstance(get_attn_backend("cpu"), TritonBackend)
