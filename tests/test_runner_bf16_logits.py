"""A bfloat16 CPU runner hands the sampler the LM head's own bfloat16 logits (no float32 copy): the head it applies
is the model's, its logits are compute_logits' values exactly, and an engine run (greedy rows, a row with logprobs,
a seeded random row, a penalty row) gives the same tokens and logprobs as the runner that calls compute_logits."""

from __future__ import annotations

import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.worker import model_runner as mr
from vllm_lite.worker import sampler as sampler_mod

PROMPTS = [[11, 12, 13, 14, 15] * 4, [21, 22, 23], [31, 32, 33, 34, 35, 36, 37], [41, 42, 43, 44]]


@pytest.fixture(scope="module")
def llm():
    with LLM(
        model=get_checkpoint("llama"), device="cpu", dtype="bfloat16", max_model_len=256, multiprocess=False
    ) as engine:
        yield engine


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def test_head_choice_and_values(llm) -> None:
    runner = _runner(llm)
    model = runner.model
    assert runner._sampling_head is model.lm_head
    assert mr._sampling_head(model, torch.device("cpu"), torch.float32) is None  # float32 models: compute_logits
    assert mr._sampling_head(model, torch.device("meta"), torch.bfloat16) is None  # not CPU (CUDA): compute_logits

    class OwnLogits(type(model)):  # a model with its own compute_logits (Gemma 2's soft cap) keeps it
        def compute_logits(self, hidden_states):
            return super().compute_logits(hidden_states) * 2

    model.__class__, cls = OwnLogits, model.__class__
    try:
        assert mr._sampling_head(model, torch.device("cpu"), torch.bfloat16) is None
    finally:
        model.__class__ = cls
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 5, 32):
            hidden = torch.randn(rows, model.lm_head.weight.shape[1], generator=g).to(torch.bfloat16)
            raw = mr.linear(hidden, runner._sampling_head, None)
            assert raw.dtype == torch.bfloat16
            assert torch.equal(raw.float(), model.compute_logits(hidden))


def _generate(llm, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def test_engine_tokens_and_logprobs_match_compute_logits(llm, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    mixes = {
        "greedy": [greedy] * 4,
        "logprobs": [greedy, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)] * 2,
        "random": [greedy] * 3 + [SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)],
        "penalty": [greedy] * 3
        + [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=2.0)],
    }
    dtypes = []
    real = sampler_mod.Sampler.forward

    def spy(self, logits, metadata, grammar_bitmask=None):
        dtypes.append(logits.dtype)
        return real(self, logits, metadata, grammar_bitmask)

    monkeypatch.setattr(sampler_mod.Sampler, "forward", spy)
    _generate(llm, mixes["greedy"])
    assert set(dtypes) == {torch.float32}  # small batches (rows x vocab under the threshold): compute_logits
    monkeypatch.setattr(sampler_mod, "BF16_ARGMAX_MIN_NUMEL", 0)  # the tiny vocabulary takes the int16 path too
    head = runner._sampling_head
    assert head is not None
    for name, params in mixes.items():
        dtypes.clear()
        fast = _generate(llm, params)
        assert dtypes and set(dtypes) == {torch.bfloat16}, name
        runner._sampling_head = None
        try:
            dtypes.clear()
            slow = _generate(llm, params)
            assert set(dtypes) == {torch.float32}, name
        finally:
            runner._sampling_head = head
        assert [t for t, _ in fast] == [t for t, _ in slow], name
        assert [lp for _, lp in fast] == [lp for _, lp in slow], name
