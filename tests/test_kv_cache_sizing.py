"""KV-cache sizing: vLLM's budget arithmetic (made-up card sizes), the worker's wiring of it on a
fake CUDA card, and the profiling pass itself (device-agnostic, run here on CPU)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.engine_args import EngineArgs
from vllm_lite.worker import gpu_worker as gpu_worker_mod
from vllm_lite.worker.gpu_worker import GPUWorker
from vllm_lite.worker.kv_cache_sizing import (
    GiB,
    blocks_per_seq,
    describe_kv_cache,
    kv_budget_from_utilization,
    max_concurrency,
    num_kv_blocks,
)

MiB = 1 << 20


def test_budget_is_utilization_of_total_less_in_use_and_peak_activations() -> None:
    # 80 GiB card at 0.9 = 72 GiB; 16 GiB in use after loading; 3 GiB activation peak -> 53 GiB.
    assert kv_budget_from_utilization(80 * GiB, 0.9, 16 * GiB, 3 * GiB) == 53 * GiB
    assert kv_budget_from_utilization(40 * GiB, 0.5, 4 * GiB, 0) == 16 * GiB


def test_budget_is_per_instance_but_never_past_what_the_card_has_free() -> None:
    # Another process holds 50 GiB of the 80: an instance at 0.3 (24 GiB) that took 2 GiB still gets
    # 24 - 2 - 1 = 21 GiB (vLLM: a per-instance share), since 28 GiB is free ...
    assert kv_budget_from_utilization(80 * GiB, 0.3, 2 * GiB, 1 * GiB, free_bytes=28 * GiB) == 21 * GiB
    # ... but only what is free, less the activation peak, when the card has less left than its share.
    assert kv_budget_from_utilization(80 * GiB, 0.9, 2 * GiB, 1 * GiB, free_bytes=10 * GiB) == 9 * GiB
    with pytest.raises(ValueError, match="0.50 GiB of the card is free"):
        kv_budget_from_utilization(80 * GiB, 0.9, 2 * GiB, 1 * GiB, free_bytes=GiB // 2)


def test_budget_with_nothing_left_names_the_figures() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.3.*24.00 GiB is in use.*2.00 GiB of activations"):
        kv_budget_from_utilization(80 * GiB, 0.3, 24 * GiB, 2 * GiB)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            kv_budget_from_utilization(80 * GiB, bad, 0, 0)


def test_num_blocks_fits_budget_and_caps_at_what_can_be_used() -> None:
    # 1 MiB blocks of 16 tokens; 10 GiB holds 10240 blocks; 64 seqs x 2048 tokens use at most 8193.
    assert num_kv_blocks(10 * GiB, MiB, 16, 2048, 64) == 64 * 128 + 1
    assert num_kv_blocks(10 * GiB, MiB, 16, 2048, 1000) == 10240
    assert num_kv_blocks(10 * GiB + MiB - 1, MiB, 16, 2048, 1000) == 10240  # partial blocks do not count


def test_num_blocks_refuses_a_cache_that_cannot_hold_one_max_length_sequence() -> None:
    assert num_kv_blocks(129 * MiB, MiB, 16, 2048, 8) == 129  # one sequence plus the null block
    with pytest.raises(ValueError, match="KV cache too small.*max_model_len=2048.*129 blocks"):
        num_kv_blocks(128 * MiB, MiB, 16, 2048, 8)


def test_a_uniform_window_bounds_the_blocks_a_sequence_needs_by_window_plus_one_step() -> None:
    # W=24, steps of at most 8 tokens, blocks of 4: keys (p-24, p+8) span at most 31 tokens -> 8 blocks + 1 partial.
    assert blocks_per_seq(4, 256, 24, 8) == 9
    assert blocks_per_seq(4, 256) == blocks_per_seq(4, 256, None, 8) == 64  # no window: the whole sequence
    assert blocks_per_seq(4, 20, 24, 8) == 5  # a window longer than the sequence saves nothing
    assert blocks_per_seq(16, 4096, 4096, 2048) == 256
    # A budget far below one max_model_len sequence serves a windowed model...
    assert num_kv_blocks(19 * MiB, MiB, 4, 256, 8, per_seq=9) == 19
    with pytest.raises(ValueError, match="KV cache too small.*needs 10 blocks"):
        num_kv_blocks(9 * MiB, MiB, 4, 256, 8, per_seq=9)
    # ...and the cap on useful blocks follows the window too: 2 sequences x 9 + the null block.
    assert num_kv_blocks(GiB, MiB, 4, 256, 2, per_seq=9) == 19
    assert max_concurrency(19, 4, 256, per_seq=9) == pytest.approx(19 / 9)
    assert "2.11x" in describe_kv_cache(19, MiB, 4, 256, per_seq=9)


def test_concurrency_and_log_line() -> None:
    assert max_concurrency(8192, 16, 4096) == 32.0
    line = describe_kv_cache(8192, 2 * MiB, 16, 4096)
    assert "8192 blocks" in line and "16.00 GiB" in line and "32.00x" in line and "max_model_len=4096" in line


class _FakeRunner:
    def __init__(self, per_block: int, peak: int) -> None:
        self.per_block, self.peak, self.profiled = per_block, peak, 0

    def kv_cache_bytes_per_block(self) -> int:
        return self.per_block

    def profile_run(self) -> int:
        self.profiled += 1
        return self.peak

    def cuda_graph_reserve_bytes(self, peak_activation_bytes: int) -> int:
        return 0  # no CUDA graphs (their reserve: tests/test_cuda_graphs.py)


def _fake_cuda_worker(monkeypatch: pytest.MonkeyPatch, cache: CacheConfig, runner: _FakeRunner) -> GPUWorker:
    """A worker on a pretend 80 GiB card with 20 GiB in use (torch.cuda's memory calls patched)."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    worker = GPUWorker.__new__(GPUWorker)  # no model, no device: only the sizing is under test
    worker.config = SimpleNamespace(
        cache_config=cache,
        scheduler_config=SchedulerConfig(max_model_len=256, max_num_seqs=100_000),
        model_config=SimpleNamespace(hf_config={"model_type": "llama", "num_hidden_layers": 2}),  # no window
    )
    worker.device = torch.device("cuda", 0)
    worker._free_at_start = 80 * GiB  # the card was empty when this instance started: it took the 20 GiB in use
    worker.model_runner = runner
    return worker


def test_cuda_worker_sizes_from_utilization_after_profiling(monkeypatch, caplog) -> None:
    runner = _FakeRunner(per_block=MiB, peak=2 * GiB)
    worker = _fake_cuda_worker(monkeypatch, CacheConfig(block_size=16, gpu_memory_utilization=0.5), runner)
    with caplog.at_level(logging.INFO, logger=gpu_worker_mod.logger.name):
        num_gpu, num_cpu = worker.determine_num_blocks()
    assert runner.profiled == 1
    assert (num_gpu, num_cpu) == ((40 - 20 - 2) * 1024, 0)  # 80 x 0.5 - 20 in use - 2 peak = 18 GiB
    kv_lines = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert len(kv_lines) == 1 and "18432 blocks" in kv_lines[0] and "18.00 GiB" in kv_lines[0]
    assert f"{16 * 18432 / 256:.2f}x" in kv_lines[0]


def test_cuda_worker_kv_cache_memory_bytes_overrides_profiling(monkeypatch) -> None:
    runner = _FakeRunner(per_block=MiB, peak=2 * GiB)
    worker = _fake_cuda_worker(monkeypatch, CacheConfig(block_size=16, kv_cache_memory_bytes=100 * MiB), runner)
    assert worker.determine_num_blocks() == (100, 0)
    assert runner.profiled == 0


def test_gpu_memory_utilization_reaches_the_cache_config_and_is_checked(tiny_checkpoint: str) -> None:
    assert (
        EngineArgs(model=tiny_checkpoint, device="cpu").create_engine_config().cache_config.gpu_memory_utilization
        == 0.9
    )
    cfg = EngineArgs(model=tiny_checkpoint, device="cpu", gpu_memory_utilization=0.6).create_engine_config()
    assert cfg.cache_config.gpu_memory_utilization == 0.6
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(model=tiny_checkpoint, device="cpu", gpu_memory_utilization=1.2).create_engine_config()


def test_profile_run_drives_the_largest_step_and_leaves_the_runner_untouched(tiny_checkpoint: str) -> None:
    from vllm_lite.worker.model_runner import GPUModelRunner

    config = EngineArgs(
        model=tiny_checkpoint,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        max_num_seqs=6,
        max_num_batched_tokens=200,
    ).create_engine_config()
    runner = GPUModelRunner(config, torch.device("cpu"))
    steps: list[tuple[dict[str, int], object]] = []
    real_step = runner._run_step

    def spy(batch, scheduled):
        out = real_step(batch, scheduled)
        steps.append((dict(scheduled), out))
        return out

    runner._run_step = spy  # type: ignore[method-assign]
    rng_before = torch.get_rng_state()
    assert runner.profile_run() == 0  # no allocator statistics off CUDA
    assert torch.equal(torch.get_rng_state(), rng_before), "profiling consumed the engine's random stream"
    assert all(layer.kv_cache is None for layer in runner.attn_layers), "the scratch KV cache stayed bound"
    assert runner.input_batch.num_reqs == 0
    ((scheduled, out),) = steps
    assert len(scheduled) == 6 and sum(scheduled.values()) == 200 and max(scheduled.values()) <= 64
    assert all(len(toks) == 1 for toks in out.sampled_token_ids), "every profiled request samples"

    # Capped by what the scheduler can ever run: max_num_seqs x max_model_len.
    runner.max_num_reqs, runner.max_num_tokens = 2, 10_000
    steps.clear()
    runner.profile_run()
    assert list(steps[0][0].values()) == [64, 64]
