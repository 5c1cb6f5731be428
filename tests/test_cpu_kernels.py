"""Native C++ CPU kernels (torch.ops.vllm_lite.*) and CpuNativeBackend against float64 oracles.

The first run compiles the kernels (~25 s) into the build cache; later runs load them.
Tolerances: float32 1e-5 absolute/relative; bfloat16 2e-2 (one bf16 ulp of the output is ~8e-3
at magnitude 1, and the oracle sees the same bf16-rounded inputs, so only the final rounding and
float32 accumulation differ).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from vllm_lite.testing.attention_oracle import random_attention_case as make_case
from vllm_lite.testing.attention_oracle import reference_paged_attention as oracle_attention
from vllm_lite.worker.attention import cpu_kernels
from vllm_lite.worker.attention.cpu_native import CpuNativeBackend
from vllm_lite.worker.attention.selector import get_attn_backend
from vllm_lite.worker.attention.torch_ref import TorchRefBackend

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def backend() -> CpuNativeBackend:
    assert cpu_kernels.load_cpu_ops(), "the CPU kernels must build on a machine with a C++ compiler"
    return CpuNativeBackend()


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)


# A decode with no context, decodes with long context, a first prefill chunk, a later chunk.
MIXED_QUERY = [1, 1, 9, 1, 23]
MIXED_SEQ = [1, 70, 9, 133, 57]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_paged_attention_mixed_batch_matches_oracle(backend, dtype, block_size, head_size, gqa):
    num_kv_heads = 2
    query, cache, md = make_case(MIXED_QUERY, MIXED_SEQ, num_kv_heads * gqa, num_kv_heads, head_size, block_size, dtype)
    scale = 1.0 / math.sqrt(head_size)
    out = backend.forward(query, cache, md, scale)
    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, oracle_attention(query, cache, md, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [48, 80])
def test_paged_attention_portable_path_for_other_head_sizes(backend, dtype, head_size):
    # Head sizes outside the AVX-512 specialisations (32/64/128/256) take the compiler-vectorised loop.
    query, cache, md = make_case(MIXED_QUERY, MIXED_SEQ, 6, 2, head_size, 16, dtype, seed=6)
    out = backend.forward(query, cache, md, 0.1)
    assert_close(out, oracle_attention(query, cache, md, 0.1), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_torch_ref_backend(backend, dtype):
    query, cache, md = make_case(MIXED_QUERY, MIXED_SEQ, 12, 4, 64, 16, dtype, seed=3)
    scale = 0.125
    out = backend.forward(query, cache, md, scale)
    ref = TorchRefBackend().forward(query, cache, md, scale)
    assert_close(out, ref, dtype)


def test_long_prefill_with_context_spans_many_query_tiles(backend):
    # 150 query tokens x 1 head per KV head -> three work items per KV head; 280 keys -> 9 key tiles.
    query, cache, md = make_case([150, 1], [280, 300], 3, 3, 64, 16, torch.float32, seed=1)
    out = backend.forward(query, cache, md, 0.1)
    assert_close(out, oracle_attention(query, cache, md, 0.1), torch.float32)


def test_non_power_of_two_group_and_strided_query(backend):
    # 12 query heads over 4 KV heads (group 3); the query is a column slice of a fused qkv tensor.
    query, cache, md = make_case(MIXED_QUERY, MIXED_SEQ, 12, 4, 64, 16, torch.float32, seed=2)
    n = query.shape[0]
    qkv = torch.randn(n, 20 * 64)
    qkv[:, : 12 * 64] = query.reshape(n, -1)
    strided = qkv[:, : 12 * 64].view(n, 12, 64)
    assert not strided.is_contiguous()
    out = backend.forward(strided, cache, md, 0.125)
    assert_close(out, oracle_attention(query, cache, md, 0.125), torch.float32)


def test_two_threads_give_the_same_result_as_one(backend):
    query, cache, md = make_case([1] * 8 + [40], [90] * 8 + [100], 8, 2, 64, 16, torch.float32, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.forward(query, cache, md, 0.125)
        torch.set_num_threads(2)
        two = backend.forward(query, cache, md, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_write_kv_places_rows_exactly_and_skips_negative_slots(backend):
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 6, 4, 2, 32, generator=g).to(torch.bfloat16)
    key = torch.randn(5, 2, 32, generator=g).to(torch.bfloat16)
    value = torch.randn(5, 2, 32, generator=g).to(torch.bfloat16)
    slots = torch.tensor([7, 0, -1, 23, 12])
    expected = cache.clone()
    keep = slots >= 0
    expected[0].view(-1, 2, 32)[slots[keep]] = key[keep]
    expected[1].view(-1, 2, 32)[slots[keep]] = value[keep]
    backend.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_write_kv_accepts_strided_rows_from_a_fused_projection(backend):
    kv = torch.randn(3, 2 * 2 * 32)
    key, value = kv[:, :64].view(3, 2, 32), kv[:, 64:].view(3, 2, 32)
    cache = torch.randn(2, 2, 4, 2, 32)
    expected = cache.clone()
    slots = torch.tensor([1, 6, 3])
    expected[0].view(-1, 2, 32)[slots] = key
    expected[1].view(-1, 2, 32)[slots] = value
    backend.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_copy_blocks_duplicates_blocks_in_every_layer(backend):
    caches = [torch.randn(2, 5, 16, 2, 64) for _ in range(3)]
    pairs = torch.tensor([[0, 3], [4, 1]])
    expected = [c.clone() for c in caches]
    for c in expected:
        c[:, [3, 1]] = c[:, [0, 4]]
    backend.copy_blocks(caches, pairs)
    for c, e in zip(caches, expected):
        assert torch.equal(c, e)
    single = torch.randn(2, 5, 16, 2, 64).to(torch.bfloat16)
    want = single.clone()
    want[:, 2] = want[:, 0]
    backend.copy_blocks(single, torch.tensor([[0, 2]]))
    assert torch.equal(single, want)


def test_swap_blocks_moves_blocks_between_caches_of_different_sizes(backend):
    device_caches = [torch.randn(2, 6, 16, 2, 32) for _ in range(2)]
    host_caches = [torch.randn(2, 3, 16, 2, 32) for _ in range(2)]
    pairs = torch.tensor([[5, 0], [1, 2]])
    expected = [h.clone() for h in host_caches]
    for e, d in zip(expected, device_caches):
        e[:, [0, 2]] = d[:, [5, 1]]
    backend.swap_blocks(device_caches, host_caches, pairs)
    for h, e in zip(host_caches, expected):
        assert torch.equal(h, e)


def test_bad_inputs_raise_clear_errors(backend):
    """Each bad input raises (it does not crash the process) with a message naming the argument and its value:
    the numbers in these messages are formatted by csrc's msg(), the path that crashed (SIGSEGV) on the H100
    image while it went through c10::str. The zero-size cases divided by zero before they were checked."""
    query, cache, md = make_case([3], [10], 4, 2, 32, 16, torch.float32)
    ops = torch.ops.vllm_lite
    out = torch.empty_like(query)
    num_blocks = cache.shape[1]
    with pytest.raises(TypeError, match="block_table must have dtype Int, got Long"):
        ops.paged_attention(out, query, cache, md.block_table.long(), md.seq_lens, md.query_start_loc, 1.0)
    with pytest.raises(ValueError, match="num_heads 3 must be a positive multiple of num_kv_heads 2"):
        ops.paged_attention(out[:, :3], query[:, :3], cache, md.block_table, md.seq_lens, md.query_start_loc, 1.0)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 2 is shorter than its query length 3"):
        ops.paged_attention(
            out, query, cache, md.block_table, torch.tensor([2], dtype=torch.int32), md.query_start_loc, 1.0
        )
    bad_table = md.block_table.clone()
    bad_table[0, 0] = 99
    with pytest.raises(ValueError, match=rf"block_table\[0, 0\] = 99 is outside the cache's {num_blocks} blocks"):
        ops.paged_attention(out, query, cache, bad_table, md.seq_lens, md.query_start_loc, 1.0)
    with pytest.raises(TypeError, match="query, out and kv_cache must share a dtype, got BFloat16, Float and Float"):
        ops.paged_attention(out, query.bfloat16(), cache, md.block_table, md.seq_lens, md.query_start_loc, 1.0)
    # Shapes the kernel once read before checking: a 2-D query (its size(2)), no heads, empty blocks.
    with pytest.raises(ValueError, match=r"query must have 3 dimensions, got shape \[3, 32\]"):
        ops.paged_attention(out[:, 0], query[:, 0], cache, md.block_table, md.seq_lens, md.query_start_loc, 1.0)
    with pytest.raises(ValueError, match="num_heads 0 must be a positive multiple"):
        ops.paged_attention(out[:, :0], query[:, :0], cache, md.block_table, md.seq_lens, md.query_start_loc, 1.0)
    with pytest.raises(ValueError, match="block_size must be > 0, got 0"):
        ops.paged_attention(out, query, cache[:, :, :0], md.block_table, md.seq_lens, md.query_start_loc, 1.0)
    slots = cache.shape[1] * 16
    with pytest.raises(ValueError, match=rf"slot_mapping\[2\] = {slots} is outside the cache's {slots} slots"):
        backend.write_kv(query[:, :2], query[:, :2], cache, torch.tensor([0, 1, slots]))
    with pytest.raises(ValueError, match=rf"src_to_dst\[0\] = {num_blocks} is outside cache 0's {num_blocks} blocks"):
        backend.copy_blocks([cache], torch.tensor([[0, num_blocks]]))
    with pytest.raises(ValueError, match=r"src_to_dst\[0, 1\] = 99 is outside dst's"):
        ops.swap_blocks(cache, cache.clone(), torch.tensor([[0, 99]]))


# TORCH_CHECK*(cond, msg) with one message argument: a string literal or msg(...). More arguments would go
# through c10::str's std::ostringstream inside the library, which crashed on the H100 image (see cpu_common.h).
_CHECK_CALL = re.compile(r"\bTORCH_CHECK\w*\s*\(")


def _top_level_args(text: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose '(' is at text[start - 1]."""
    args, depth, cur, i, quote = [], 0, [], start, None
    while True:
        c = text[i]
        if quote:
            cur.append(c)
            if c == "\\":
                cur.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            cur.append(c)
        elif c in "([{":
            depth += 1
            cur.append(c)
        elif c in ")]}":
            if depth == 0:
                args.append("".join(cur).strip())
                return args
            depth -= 1
            cur.append(c)
        elif c == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1


def test_native_error_messages_never_stream_values_through_c10_str():
    sources = [p for p in cpu_kernels.source_files() if p.suffix in (".cpp", ".h")]
    checked = 0
    for path in sources:
        text = path.read_text()
        for m in _CHECK_CALL.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            args = _top_level_args(text, m.end())
            assert len(args) == 2, f"{path.name}:{line}: pass the message as one msg(...) or literal, got {args}"
            assert args[1].startswith('"') or args[1].startswith("msg("), f"{path.name}:{line}: {args[1]}"
            checked += 1
    assert checked > 40  # the scan found the checks


def test_selector_prefers_native_cpu_and_honours_forced_names(backend, monkeypatch):
    monkeypatch.delenv("VLLM_LITE_ATTENTION_BACKEND", raising=False)
    assert isinstance(get_attn_backend(torch.device("cpu")), CpuNativeBackend)
    assert isinstance(get_attn_backend(torch.device("cpu"), "torch"), TorchRefBackend)
    monkeypatch.setenv("VLLM_LITE_ATTENTION_BACKEND", "torch")
    assert isinstance(get_attn_backend(torch.device("cpu")), TorchRefBackend)
    with pytest.raises(ValueError, match="VLLM_LITE_ATTENTION_BACKEND"):
        monkeypatch.setenv("VLLM_LITE_ATTENTION_BACKEND", "flash")
        get_attn_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="name"):
        get_attn_backend(torch.device("cpu"), "cuda-graphs")


def _run_loader(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from vllm_lite.worker.attention.cpu_kernels import load_cpu_ops
        print("RESULT", load_cpu_ops())
        """
    )
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_second_process_loads_kernels_from_the_cache(backend):
    proc = _run_loader({})
    assert "RESULT True" in proc.stdout, proc.stderr
    assert "loaded cached CPU kernels" in proc.stderr
    assert "building vllm-lite CPU kernels" not in proc.stderr


def test_missing_compiler_falls_back_with_a_warning(tmp_path):
    proc = _run_loader({"VLLM_LITE_CACHE_DIR": str(tmp_path), "CXX": "/nonexistent/c++"})
    assert "RESULT False" in proc.stdout, proc.stderr
    assert "falling back to the PyTorch reference" in proc.stderr


def test_a_build_leaves_the_build_key_as_it_was(tmp_path, monkeypatch):
    """torch's cpp_extension.load appends its link flags to the extra_ldflags list it is handed; the key of the
    build just made must still be the key this process computes afterwards (the wheel test checks it)."""
    import torch.utils.cpp_extension as ext

    def load(name, sources, extra_cflags, extra_ldflags, build_directory, **kw):
        extra_cflags.append("-DADDED_BY_LOAD")  # what torch 2.13 does to the lists it is given
        extra_ldflags += ["-L/somewhere", "-ltorch"]
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setenv("VLLM_LITE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ext, "load", load)
    monkeypatch.setattr(cpu_kernels.host, "cxx_compiler", lambda: "/usr/bin/c++")
    before = cpu_kernels.build_key()
    cpu_kernels._build_or_load()
    assert cpu_kernels.build_key() == before
    assert "-ltorch" not in cpu_kernels.EXTRA_LDFLAGS and "-DADDED_BY_LOAD" not in cpu_kernels.EXTRA_CFLAGS


# ---------------------------------------------------------------------------- where the sources live
REPO = Path(__file__).resolve().parents[1]


def test_sources_live_in_the_top_level_csrc_and_the_package_holds_only_python():
    assert cpu_kernels.csrc_dir() == REPO / "csrc"
    names = {p.name for p in cpu_kernels.source_files()}
    assert {"attention.cpp", "cache_ops.cpp", "torch_bindings.cpp", "ops.h", "cpu_common.h"} <= names
    native = [p for p in (REPO / "vllm_lite").rglob("*") if p.suffix in (".cpp", ".h", ".cu", ".cc")]
    assert native == []


def test_loader_reports_its_result_to_the_platform_module(backend):
    from vllm_lite import platform

    assert platform.native_kernels_loaded() is True and platform.native_kernels().ok


@pytest.mark.slow
def test_wheel_ships_the_sources_and_an_installed_copy_loads_the_same_kernels(backend, project_wheel, tmp_path):
    """A regular (non-editable) install has no repository beside it: the wheel carries the sources as
    vllm_lite/_csrc, and the loader there hashes them to the same key, so it loads the cached build."""
    wheel = project_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for p in cpu_kernels.source_files():
        assert f"vllm_lite/_csrc/{p.name}" in names, p.name
    assert not [n for n in names if n.startswith("csrc/")]  # nothing outside the package
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = textwrap.dedent(
        """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        import vllm_lite
        from vllm_lite.worker.attention import cpu_kernels
        print(vllm_lite.__file__)
        print(cpu_kernels.csrc_dir())
        print(cpu_kernels.build_key())
        print(cpu_kernels.load_cpu_ops())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    pkg_file, csrc, key, loaded = out.stdout.split()
    assert pkg_file == str(site / "vllm_lite" / "__init__.py")
    assert csrc == str(site / "vllm_lite" / "_csrc")
    assert key == cpu_kernels.build_key()
    assert loaded == "True" and "loaded cached CPU kernels" in out.stderr
