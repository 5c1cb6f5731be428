"""sampler.greedy_argmax: the numpy path for float32 CPU logits returns exactly torch's argmax (first maximum,
NaN as the maximum), on the shapes and layouts the sampler sees, and the sampler's greedy rows take it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_lite.worker import sampler as sampler_mod
from vllm_lite.worker.sampler import greedy_argmax


def _hard_rows(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, vocab, generator=g)
    x[0, 5] = x[0, 9] = x[0].max() + 1  # a tie: the first wins
    x[1, :] = float("-inf")  # every token banned: token 0
    x[2, 7] = float("nan")  # NaN counts as the maximum
    x[2, 3] = float("inf")
    x[3, 11] = x[3, 2] = float("inf")  # two +inf: the first
    x[4, :] = float("nan")
    x[5, :] = 0.0  # all equal: token 0
    x[6, -1] = 1e30  # the last column
    x[7] = x[7].to(torch.bfloat16).float()  # bf16-rounded logits (many exact ties)
    return x


@pytest.mark.parametrize("vocab", [1, 17, 32000])
def test_matches_torch_argmax(vocab: int) -> None:
    x = _hard_rows(max(vocab, 12))[:, :vocab].contiguous()
    got = greedy_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (10,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_layouts_and_inference_mode() -> None:
    x = _hard_rows(300)
    with torch.inference_mode():
        y = x.clone()
        assert torch.equal(greedy_argmax(y), y.argmax(dim=-1))
    strided = x[::2, 1::3]  # a non-contiguous view
    assert torch.equal(greedy_argmax(strided), strided.argmax(dim=-1))
    wide = torch.cat([x, x], dim=1)[:, 300:]
    assert torch.equal(greedy_argmax(wide), wide.argmax(dim=-1))
    assert torch.equal(greedy_argmax(x[:0]), x[:0].argmax(dim=-1))  # no rows
    bf = x.to(torch.bfloat16)  # another dtype: torch's own argmax
    assert torch.equal(greedy_argmax(bf), bf.argmax(dim=-1))


def test_result_is_writable_for_mixed_batches() -> None:
    out = greedy_argmax(_hard_rows(64))
    out[0] = 3  # random rows are written into the greedy result (Sampler.forward)
    assert int(out[0]) == 3


def test_sampler_greedy_rows_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-greedy batch goes through numpy's argmax (what makes it fast), with torch's result."""
    from vllm_lite.sampling_params import SamplingParams
    from vllm_lite.worker.sampling_state import SamplingState

    calls = []
    real = np.argmax

    def spy(a, *args, **kwargs):
        calls.append(a.shape)
        return real(a, *args, **kwargs)

    monkeypatch.setattr(sampler_mod.np, "argmax", spy)
    vocab = 50
    state = SamplingState(4, vocab, 64, torch.device("cpu"))
    for row in range(4):
        state.add_request(row, SamplingParams(temperature=0.0), [1, 2, 3], [], None)
    md = state.make_metadata(np.arange(4, dtype=np.int64))
    logits = _hard_rows(vocab)[:4].contiguous()
    out = sampler_mod.Sampler()(logits, md)
    assert calls == [(4, vocab)]
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
