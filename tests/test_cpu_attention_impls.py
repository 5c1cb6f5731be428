"""Every key loop of the C++ CPU attention kernel (AVX-512, AVX2, portable) against the float64 oracle,
and the rule that picks one.

Each built key loop is forced in turn (CpuNativeBackend(impl=...)), so an AVX-512 host (which builds
AVX2 too) tests both vector paths, and an AVX2 host tests the one it runs. Tolerances as in
test_cpu_kernels.py: float32 1e-5; bfloat16 KV 3e-2 (bf16 output rounding plus soft-cap/window edges).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from vllm_lite.testing.attention_oracle import poison_blocks_before_window
from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.attention_oracle import reference_paged_attention as oracle_attention
from vllm_lite.worker.attention import cpu_kernels
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# Decodes with and without context, a first prefill chunk, later chunks longer than a 16-key tile.
QUERY = [1, 1, 9, 1, 23, 40]
SEQ = [1, 70, 9, 133, 57, 200]


@pytest.fixture(scope="module")
def backends() -> dict[str, CpuNativeBackend]:
    assert cpu_kernels.load_cpu_ops(), "the CPU kernels must build on a machine with a C++ compiler"
    return {impl: CpuNativeBackend(impl) for impl in CpuNativeBackend().built_impls()}


def _check_every_impl(backends, query, cache, md, scale, window=None, cap=None, dtype=torch.float32):
    expected = oracle_attention(query, cache, md, scale, window, cap)
    for impl, backend in backends.items():
        out = backend.forward(query, cache, md, scale, window, cap)
        assert out.shape == query.shape and out.dtype == query.dtype
        torch.testing.assert_close(
            out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype], msg=lambda m, impl=impl: f"{impl}: {m}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [16, 32, 64, 128])
@pytest.mark.parametrize("gqa", [1, 3])
def test_every_key_loop_matches_the_oracle_over_a_mixed_batch(backends, dtype, head_size, gqa):
    query, cache, md = make_case(QUERY, SEQ, 2 * gqa, 2, head_size, 16, dtype, seed=head_size + gqa)
    _check_every_impl(backends, query, cache, md, 1.0 / math.sqrt(head_size), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 96])
def test_every_key_loop_keeps_sliding_windows_and_soft_caps(backends, dtype, head_size):
    # Window 5 and 37 cut inside a 16-key tile; blocks wholly before the window hold NaN (never read).
    for window, cap, seed in ((5, None, 1), (37, None, 2), (None, 30.0, 3), (37, 10.0, 4)):
        query, cache, md = make_case(QUERY, SEQ, 6, 2, head_size, 16, dtype, seed=seed)
        if window is not None:
            cache = poison_blocks_before_window(cache, md, window)
        _check_every_impl(backends, query, cache, md, 1.0 / math.sqrt(head_size), window, cap, dtype)


def test_every_key_loop_handles_one_token_blocks_and_a_partial_last_tile(backends):
    # block_size 1: every key of a tile comes from a different block; 133 keys leave a 5-key last tile.
    query, cache, md = make_case(QUERY, SEQ, 4, 2, 32, 1, torch.float32, seed=9)
    _check_every_impl(backends, query, cache, md, 0.2)


def test_avx2_is_built_on_every_x86_host_with_avx2(backends):
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        assert "avx2" in backends
    if capability == "AVX512":
        assert "avx512" in backends
    assert list(backends)[-1] == "portable"


def test_auto_picks_the_fastest_built_loop_that_fits_the_head_size(backends):
    auto = CpuNativeBackend("auto")
    built = set(backends)
    best_vector = "avx512" if "avx512" in built else "avx2" if "avx2" in built else "portable"
    assert auto.key_loop(64) == best_vector
    # AVX-512 covers 32/64/128/256 without soft-capping; AVX2 multiples of 8 it lists, soft-capping too.
    assert auto.key_loop(80) == ("avx2" if "avx2" in built else "portable")
    assert auto.key_loop(64, 50.0) == ("avx2" if "avx2" in built else "portable")
    assert auto.key_loop(40) == "portable"
    assert backends["portable"].key_loop(64) == "portable"
    if "avx2" in built:
        assert backends["avx2"].key_loop(128) == "avx2"


def test_a_bad_or_unbuilt_impl_is_a_value_error_naming_impl():
    with pytest.raises(ValueError, match="impl"):
        CpuNativeBackend("sse9")
    missing = [impl for impl in ("avx512", "avx2") if impl not in CpuNativeBackend().built_impls()]
    for impl in missing:
        with pytest.raises(ValueError, match="impl"):
            CpuNativeBackend(impl)
    with pytest.raises(ValueError, match="impl"):
        torch.ops.vllm_lite.paged_attention_impl(64, 0.0, "neon")


def test_the_chosen_key_loop_is_logged_once_per_head_size(backends, caplog):
    query, cache, md = make_case([1, 3], [10, 12], 4, 2, 32, 16, torch.float32, seed=5)
    backend = CpuNativeBackend("auto")
    with caplog.at_level(logging.INFO, logger="vllm_lite.worker.attention.cpu_native"):
        backend.forward(query, cache, md, 0.2)
        backend.forward(query, cache, md, 0.2)
    lines = [r.getMessage() for r in caplog.records if "CPU paged attention" in r.getMessage()]
    assert lines == [f"CPU paged attention: {backend.key_loop(32)} key loop (head size 32, impl=auto)"]
