"""Past the last attention, a bf16 step computes only the rows it samples from (models/decoder.py).

The last layer's MLP (and final norm) of a prefill runs on each sampling request's last token instead of the
whole prompt; prompt-logprob steps, float32 models and chunks that sample nothing keep their exact behaviour.
Each test records the rows that reach the first and the last layer's MLP, and compares what the requests got
with the same run where the runner asks for every row.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.core_harness import make_request, tiny_engine_core, unique_id
from vllm_lite.worker.model_runner import GPUModelRunner

PROMPTS = [list(range(5, 25)), list(range(40, 53)), list(range(7, 12))]  # 20, 13 and 5 tokens


def _runner(core: Any) -> GPUModelRunner:
    return core.executor.worker.model_runner


class _MlpRows:
    """Rows reaching the first and the last decoder layer's MLP, per call."""

    def __init__(self, runner: GPUModelRunner) -> None:
        layers = runner.model.model.layers
        self.first: list[int] = []
        self.last: list[int] = []
        self._hooks = [
            layers[0].mlp.register_forward_pre_hook(lambda m, a: self.first.append(a[0].shape[0])),
            layers[-1].mlp.register_forward_pre_hook(lambda m, a: self.last.append(a[0].shape[0])),
        ]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _run(core: Any, requests: list[tuple[list[int], SamplingParams]]) -> tuple[dict[str, Any], _MlpRows]:
    """Add the requests at once, step until done; (outputs by position, MLP rows seen)."""
    rows = _MlpRows(_runner(core))
    ids = []
    for prompt, params in requests:
        ids.append(unique_id("rows"))
        core.add_request(make_request(ids[-1], prompt, params))
    got: dict[str, Any] = {i: {"tokens": [], "logprobs": [], "prompt_logprobs": []} for i in ids}
    try:
        while core.has_unfinished_requests():
            for outs in core.step().values():
                for out in outs.outputs:
                    g = got[out.request_id]
                    g["tokens"] += out.new_token_ids
                    if out.new_logprobs is not None:
                        g["logprobs"].append(out.new_logprobs.logprobs.clone())
                    if out.new_prompt_logprobs_tensors is not None:
                        g["prompt_logprobs"].append(out.new_prompt_logprobs_tensors.logprobs.clone())
    finally:
        rows.remove()
    return {str(k): got[i] for k, i in enumerate(ids)}, rows


@pytest.fixture(scope="module")
def bf16_core() -> Iterator[Any]:
    yield tiny_engine_core(dtype="bfloat16", max_num_batched_tokens=64, num_threads=1, enable_prefix_caching=False)


def _every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GPUModelRunner, "_logits_rows", lambda self, batch, inputs, so: None)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        assert a[k]["tokens"] == b[k]["tokens"], k
        for x, y in zip(a[k]["logprobs"], b[k]["logprobs"], strict=True):
            torch.testing.assert_close(x, y, atol=0.02, rtol=0.0)  # bf16 sums of another row count
        for x, y in zip(a[k]["prompt_logprobs"], b[k]["prompt_logprobs"], strict=True):
            assert torch.equal(x, y), k  # prompt-logprob steps run every row: unchanged bit for bit


def test_bf16_prefill_runs_the_last_mlp_on_sampling_rows_only(bf16_core: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
    got, rows = _run(bf16_core, [(p, params) for p in PROMPTS])
    assert rows.first[0] == sum(map(len, PROMPTS))  # the prefill step: every prompt token in the first layer
    assert rows.last[0] == len(PROMPTS)  # one row per request past the last attention
    assert rows.first[1:] == rows.last[1:] == [len(PROMPTS)] * 2  # decode steps: every row samples
    _every_row(monkeypatch)
    want, rows = _run(bf16_core, [(p, params) for p in PROMPTS])
    assert rows.last[0] == sum(map(len, PROMPTS))
    _same(got, want)


def test_prompt_logprobs_step_keeps_every_row(bf16_core: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with_lp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    requests = [(PROMPTS[0], plain), (PROMPTS[1], with_lp)]
    got, rows = _run(bf16_core, requests)
    assert rows.last[0] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert got["1"]["prompt_logprobs"] and got["1"]["prompt_logprobs"][0].shape[0] == len(PROMPTS[1]) - 1
    _every_row(monkeypatch)
    want, _ = _run(bf16_core, requests)
    _same(got, want)


def test_chunks_that_sample_nothing_skip_the_last_mlp() -> None:
    core = tiny_engine_core(dtype="bfloat16", max_num_batched_tokens=16, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(3, 43))  # 40 tokens: chunks of 16, 16, 8
    got, rows = _run(core, [(prompt, params)])
    assert rows.first[:3] == [16, 16, 8]
    assert rows.last == [1, 1]  # the two middle-of-prompt chunks never reach it; the last chunk and one decode
    assert len(got["0"]["tokens"]) == 2


def test_float32_keeps_every_row() -> None:
    core = tiny_engine_core(dtype="float32", num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    _, rows = _run(core, [(p, params) for p in PROMPTS])
    assert rows.last[0] == rows.first[0] == sum(map(len, PROMPTS))
