"""Budgets of device work outside the model forward, per step kind (issue 20: on a GPU a small step is bound by
host work, every eager op and every host sync costs): counted on CPU through the CUDA-graph replay path with
stand-in graphs (vllm_lite/testing/device_ops.py), the rejection sampler's numpy shortcuts for CPU tensors off so
the device path is what gets counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vllm_lite.spec_decode.rejection_sampler as rejection_sampler
import vllm_lite.worker.sampler as sampler
from vllm_lite import SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.device_ops import DeviceOpCounter, count_steps, install_stand_in_graphs
from vllm_lite.worker.spec_decode_step import SpecDecodeStep

K = 5
PROMPT = [11, 12, 13, 14, 15] * 6

# Non-view ops (kernels, copies) of a batch-1 step outside the forward. Measured at this commit: plain decode 15
# (6 of them the replay's input copies), n-gram verify 11 (the same copies, LM head, argmax, the sync).
DECODE_KERNELS = 15
VERIFY_KERNELS = 12


def test_counter_sees_ops_syncs_and_host_to_device_copies() -> None:
    with DeviceOpCounter() as c:
        host = torch.from_numpy(np.arange(6)).to("cpu")  # host data moved to "the device": one h2d, no sync
        dev = host * 2
        host.tolist()  # reading host data is free
        dev.sum().item()  # sync 1
        dev[dev > 2]  # sync 2: a boolean mask's size depends on device data
        dev.cpu().numpy()  # sync 3 (once: .cpu() made host data)
        with c.paused():
            dev + 1  # not counted
        if dev.any():  # sync 4
            pass
    assert c.h2d == 1
    assert c.num_syncs == 4, c.syncs
    assert c.ops["aten.mul.Tensor"] == 1 and "aten.add.Tensor" not in c.ops
    assert c.num_kernels == c.num_ops  # no views here


@pytest.fixture
def device_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejection_sampler, "HOST_FAST_PATHS", False)
    monkeypatch.setattr(sampler, "HOST_FAST_PATHS", False)
    monkeypatch.setattr(SpecDecodeStep, "gain_rule", False)


def _steps(speculative: bool) -> list:
    from vllm_lite.entrypoints.llm import LLM

    kw: dict = dict(model=get_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=256)
    keys = [(1, 1)]
    if speculative:
        kw["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
        keys += [(1, q) for q in range(2, K + 2)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(multiprocess=False, **kw) as llm:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        install_stand_in_graphs(runner, keys)
        with count_steps(runner, where=True) as records:
            llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return records


def test_plain_decode_step_budget(device_paths: None) -> None:
    decodes = [r for r in _steps(speculative=False) if r.kind == "decode"]
    assert decodes
    for r in decodes:
        assert len(r.syncs) == 1, r.syncs  # the sampled tokens coming back
        assert r.num_kernels <= DECODE_KERNELS, r.ops


def test_batch1_verify_step_budget(device_paths: None) -> None:
    verifies = [r for r in _steps(speculative=True) if r.kind == "verify"]
    assert verifies, "the repeating prompt should give n-gram drafts"
    for r in verifies:
        assert len(r.syncs) == 1, r.syncs  # only the one that returns the tokens
        assert r.h2d == 0, r.ops  # drafts are matched on the host, logits rows are a slice
        assert r.num_kernels <= VERIFY_KERNELS, r.ops
