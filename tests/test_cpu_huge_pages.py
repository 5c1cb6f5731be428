"""Weight copies in huge-page-advised memory (vllm_lite/worker/models/cpu_huge_pages.py) and their use by prepacking."""

from __future__ import annotations

import copy
import errno
import gc
import logging
import mmap
import pickle

import pytest
import torch

from vllm_lite.engine_args import EngineArgs
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.worker.model_loader import load_model
from vllm_lite.worker.models import cpu_huge_pages, cpu_prepack
from vllm_lite.worker.models.cpu_huge_pages import huge_page_contiguous, is_huge_page_advised

needs_madvise = pytest.mark.skipif(not cpu_huge_pages.supported(), reason="mmap has no MADV_HUGEPAGE here (not Linux)")


@pytest.fixture
def fresh_arena(monkeypatch):
    """Each test starts its own arena (and leaves the module's as it was)."""
    monkeypatch.setattr(cpu_huge_pages, "_arena", [None])
    monkeypatch.setattr(cpu_huge_pages, "ENABLED", [True])
    monkeypatch.setattr(cpu_huge_pages, "_refused", [None])
    yield


@needs_madvise
def test_copy_of_a_strided_view_is_contiguous_equal_and_advised(fresh_arena) -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    view = w.reshape(16, 4, 3, 32).permute(0, 2, 1, 3)
    got = huge_page_contiguous(view)
    assert got.is_contiguous() and got.shape == view.shape and got.dtype == view.dtype
    assert torch.equal(got, view.contiguous())
    assert is_huge_page_advised(got)
    assert not is_huge_page_advised(view.contiguous())  # ordinary memory is not


@needs_madvise
def test_copies_share_an_arena_without_overlap_and_big_ones_get_their_own(fresh_arena, monkeypatch) -> None:
    monkeypatch.setattr(cpu_huge_pages, "ARENA_BYTES", 1 << 20)
    a = huge_page_contiguous(torch.ones(1000, dtype=torch.float32))
    b = huge_page_contiguous(torch.full((3000,), 2.0))
    assert a.data_ptr() % cpu_huge_pages.ALIGN == 0 and b.data_ptr() % cpu_huge_pages.ALIGN == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel() * 4  # the same arena, one after the other
    big = huge_page_contiguous(torch.full((600_000,), 3.0))  # 2.4 MB: past the (test's) 1 MiB arena
    assert big.data_ptr() % cpu_huge_pages.HUGE_PAGE == 0  # a fresh arena starts at a 2 MiB boundary
    a.fill_(7.0)
    assert (b == 2.0).all() and (big == 3.0).all() and (a == 7.0).all()
    assert is_huge_page_advised(big)


@needs_madvise
def test_a_copy_outlives_its_arena_handle_and_pickles_as_ordinary_memory(fresh_arena) -> None:
    t = huge_page_contiguous(torch.arange(5000, dtype=torch.int64))
    cpu_huge_pages._arena[0] = None  # the module forgets the arena; the tensor keeps its mapping alive
    gc.collect()
    assert torch.equal(t, torch.arange(5000))
    back = pickle.loads(pickle.dumps(t))
    assert torch.equal(back, t) and not is_huge_page_advised(back)
    assert torch.equal(copy.deepcopy(t), t)


@needs_madvise
def test_an_arena_is_unmapped_when_its_last_copy_is_dropped(fresh_arena) -> None:
    """The module holds its arena weakly: a dropped model's weight copies give their memory back (a 300 MB LM head
    copy used to stay resident as the module's current arena)."""
    a = huge_page_contiguous(torch.ones(1000))
    b = huge_page_contiguous(torch.ones(2000))
    arena = cpu_huge_pages._arena[0]
    assert arena is not None and arena.mapping() is not None
    del a
    gc.collect()
    assert arena.mapping() is not None  # b still lives in it
    del b
    gc.collect()
    assert arena.mapping() is None
    c = huge_page_contiguous(torch.full((10,), 5.0))  # a new arena, not the dead one's tail
    assert cpu_huge_pages._arena[0] is not arena and torch.equal(c, torch.full((10,), 5.0))
    assert c.data_ptr() % cpu_huge_pages.HUGE_PAGE == 0


class _RefusingMmap:
    """mmap as a kernel without transparent huge pages answers: the advice fails with EINVAL."""

    MAP_PRIVATE = mmap.MAP_PRIVATE
    MAP_ANONYMOUS = mmap.MAP_ANONYMOUS
    MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)

    class mmap(mmap.mmap):  # noqa: N801 - stands in for the module's class
        def madvise(self, *args: object) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")


def test_a_host_that_refuses_the_advice_gets_ordinary_copies_and_one_warning(fresh_arena, monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_huge_pages, "mmap", _RefusingMmap)
    monkeypatch.setattr(cpu_huge_pages, "supported", lambda: True)
    w = torch.randn(8, 6)
    with caplog.at_level(logging.WARNING, logger=cpu_huge_pages.__name__):
        got = [huge_page_contiguous(w.t()) for _ in range(3)]
    assert all(g.is_contiguous() and torch.equal(g, w.t()) for g in got)
    assert cpu_huge_pages._refused[0] is not None and "Invalid argument" in cpu_huge_pages._refused[0]
    assert len([r for r in caplog.records if "huge-page" in r.getMessage()]) == 1


def test_turned_off_gives_ordinary_contiguous_tensors(fresh_arena) -> None:
    cpu_huge_pages.ENABLED[0] = False
    view = torch.randn(8, 6).t()
    got = huge_page_contiguous(view)
    assert got.is_contiguous() and torch.equal(got, view)
    assert cpu_huge_pages._arena[0] is None


def _bf16_model() -> torch.nn.Module:
    cfg = EngineArgs(model=get_checkpoint("qwen2"), dtype="bfloat16", device="cpu").create_engine_config()
    return load_model(cfg.model_config, torch.device("cpu"))


@needs_madvise
@pytest.mark.skipif(not cpu_prepack.small_m_kernel_available(), reason="bf16 decode kernels not built here")
def test_prepacking_puts_the_decode_kernels_weight_copies_in_huge_pages(fresh_arena) -> None:
    model = _bf16_model()
    assert cpu_prepack.prepack_linear_weights(model) > 0
    copies = [
        t
        for m in model.modules()
        for t in (getattr(m, "small_m_weight", None), getattr(m, "vnni_weight", None))
        if t is not None
    ]
    assert copies and all(is_huge_page_advised(t) for t in copies)
    cpu_huge_pages.ENABLED[0] = False
    plain = _bf16_model()
    cpu_prepack.prepack_linear_weights(plain)
    pairs = [
        (getattr(a, attr), getattr(b, attr))
        for a, b in zip(model.modules(), plain.modules())
        for attr in ("small_m_weight", "vnni_weight")
        if getattr(a, attr, None) is not None
    ]
    assert len(pairs) == len(copies)
    for hp, ordinary in pairs:
        assert not is_huge_page_advised(ordinary) and torch.equal(hp, ordinary)
