"""capture_cuda_graphs tells speculative decoding which verify graphs exist: their {q: batch sizes} after a
capture, None after a failed one (CPU: a stand-in CudaDecodeGraphs, the runner's method on a stub runner)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_lite.worker import model_runner as mr


class FakeGraphs:
    fail = False

    def __init__(self, *args, keys=None, **kwargs) -> None:
        self.by_q = {1: [8, 4], 3: [4]}

    def capture(self) -> None:
        if FakeGraphs.fail:
            raise RuntimeError("capture broke")

    def describe(self, reserved) -> str:
        return "fake graphs"


class RecordingSpec:
    def __init__(self) -> None:
        self.calls: list = []

    def set_verify_graphs(self, graphs) -> None:
        self.calls.append(graphs)


def stub_runner(spec) -> SimpleNamespace:
    return SimpleNamespace(
        cudagraph_sizes=[4, 8],
        kv_caches=[object()],
        model=None,
        backend=None,
        device=None,
        block_size=16,
        max_blocks_per_req=4,
        max_model_len=64,
        cudagraph_keys=[(8, 1), (4, 1), (4, 3)],
        lora_manager=None,
        spec_decode=spec,
        cuda_graphs=None,
        cuda_graph_reserved=None,
    )


@pytest.mark.parametrize("fail", [False, True])
def test_verify_graphs_reach_spec_decode(monkeypatch, fail):
    monkeypatch.setattr(mr, "CudaDecodeGraphs", FakeGraphs)
    monkeypatch.setattr(FakeGraphs, "fail", fail)
    spec = RecordingSpec()
    runner = stub_runner(spec)
    mr.GPUModelRunner.capture_cuda_graphs(runner)
    if fail:
        assert runner.cuda_graphs is None and spec.calls == [None]
    else:
        assert runner.cuda_graphs is not None and spec.calls == [{1: [8, 4], 3: [4]}]


def test_no_spec_decode_no_call(monkeypatch):
    monkeypatch.setattr(mr, "CudaDecodeGraphs", FakeGraphs)
    runner = stub_runner(None)
    mr.GPUModelRunner.capture_cuda_graphs(runner)  # spec_decode None: nothing to tell
    assert runner.cuda_graphs is not None
