"""The all-greedy sampler over bfloat16 logits (CPU: the runner hands over the LM head's own output, no float32
copy) picks exactly the token the float32 path picks: torch's and numpy's argmax over the logits' exact float32
conversion (first maximum, NaN the maximum, -0 == +0), on crafted rows (ties, signed zeros, subnormals, NaNs of
either sign, infinities) and on every bfloat16 bit pattern; batches that need float32 (logprobs, processors,
random rows) get the float32 path's tokens and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker import sampler as sampler_mod
from vllm_lite.worker.sampler import Sampler, greedy_argmax
from vllm_lite.worker.sampling_state import SamplingState

VOCAB = 9000  # 32 rows x 9000 logits: past the int16 path's size threshold
ROWS = 32


def _bits(*patterns: int) -> torch.Tensor:
    """bfloat16 values from their bit patterns (0x0000-0xFFFF)."""
    return torch.tensor(np.array(patterns, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def _crafted() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(ROWS, VOCAB, generator=g) * 4).to(torch.bfloat16)
    x[0, 5] = x[0, 9] = x[0].max() + 1  # a tie: the first wins
    x[1] = -x[1].abs() - 1  # every logit negative
    x[2, :] = float("-inf")  # every token banned: token 0
    x[3, 7] = float("nan")
    x[3, 3] = float("inf")  # a positive NaN counts as the maximum, past +inf
    x[4, 11] = x[4, 2] = float("inf")  # two +inf: the first
    x[5, :] = 0.0
    x[5, 4] = -0.0  # a zero row: token 0 (+0 == -0)
    x[6, :] = -1.0
    x[6, 3] = -0.0
    x[6, 8] = 0.0  # -0 before +0 at the top: -0 (equal in float; +0's pattern is the larger int16)
    x[7, -1] = x[7].max() + 2  # the last column
    x[8, 100] = _bits(0xFFC1)[0]  # a negative NaN among positive logits: the NaN
    x[9, 50] = _bits(0xFFFF)[0]  # the largest negative NaN pattern
    x[9, 60] = _bits(0x7FC0)[0]  # and a positive NaN after it: the first NaN
    x[10, :] = _bits(0x8001)[0]  # tiny negatives ...
    x[10, 77] = _bits(0x0001)[0]  # ... and one positive subnormal at the top
    x[11, :] = 0.0
    x[11, 30] = _bits(0x0005)[0]
    x[11, 31] = _bits(0x0007)[0]  # subnormals only: the larger
    x[12, :] = _bits(0x0080)[0]  # the smallest normal everywhere: token 0
    x[13, 1000] = _bits(0x7F7F)[0]  # the largest finite bfloat16
    x[13, 2000] = _bits(0x7F7F)[0]
    x[14, :] = float("nan")
    x[15, :] = _bits(0xFF80)[0]  # -inf row of the bit pattern kind
    x[15, 9] = _bits(0xFF81)[0]  # one negative NaN
    x[16, 0] = x[16].max() + 1  # the first column
    x[17, 5] = _bits(0x7FC0)[0]
    x[17, 6] = _bits(0x7FFF)[0]  # two positive NaNs, the larger pattern second: the first
    return x.contiguous()


def _float_argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.argmax(x.float().numpy(), axis=1))


def test_torch_tie_rule_is_first_maximum_for_both_dtypes() -> None:
    """The rule the int16 path copies: torch's CPU argmax gives the first maximum in bfloat16 and float32, and the
    two agree (the conversion is exact)."""
    x = _bits(0x3F80, 0x4000, 0x3F80, 0x4000, 0x4000).view(1, -1)  # 1, 2, 1, 2, 2
    assert x.argmax(dim=-1).item() == 1 and x.float().argmax(dim=-1).item() == 1
    zeros = _bits(0x8000, 0x0000, 0x8000).view(1, -1)  # -0, +0, -0: all equal
    assert zeros.argmax(dim=-1).item() == 0 and zeros.float().argmax(dim=-1).item() == 0
    nans = _bits(0x3F80, 0xFFC1, 0x7FC0).view(1, -1)  # 1, -NaN, +NaN: the first NaN
    assert nans.argmax(dim=-1).item() == 1 and nans.float().argmax(dim=-1).item() == 1
    x = _crafted()
    assert torch.equal(x.argmax(dim=-1), x.float().argmax(dim=-1))


def test_crafted_rows_match_the_float32_argmax() -> None:
    x = _crafted()
    assert x.numel() >= sampler_mod.BF16_ARGMAX_MIN_NUMEL  # the int16 path, not the small-batch copy
    want = _float_argmax(x)
    assert torch.equal(want, x.float().argmax(dim=-1))
    got = greedy_argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == want.tolist()
    expected = {0: 5, 2: 0, 3: 7, 4: 2, 5: 0, 6: 3, 7: VOCAB - 1, 8: 100, 9: 50, 10: 77, 11: 31, 12: 0, 13: 1000}
    assert {r: got[r].item() for r in expected} == expected
    assert got[14].item() == 0 and got[15].item() == 9 and got[16].item() == 0 and got[17].item() == 5
    # Each crafted row alone among ordinary rows (the batch-wide checks see only its case).
    plain = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    for r in range(18):
        batch = plain.clone()
        batch[r % ROWS] = x[r]
        assert greedy_argmax(batch).tolist() == _float_argmax(batch).tolist(), r


@pytest.mark.parametrize("seed", [0, 1])
def test_every_bfloat16_pattern(seed: int) -> None:
    """Rows drawn from all 65,536 bit patterns (NaNs of both signs, infinities, zeros, subnormals), then the same
    rows without NaNs, and rows of only finite values with many exact ties."""
    rng = np.random.default_rng(seed)
    every = np.arange(65536, dtype=np.uint16)
    rows = [rng.permutation(every)[:VOCAB] for _ in range(ROWS)]
    x = torch.from_numpy(np.stack(rows).view(np.int16)).view(torch.bfloat16)
    assert greedy_argmax(x).tolist() == _float_argmax(x).tolist()
    finite = every[(every & 0x7F80) != 0x7F80]  # no NaN, no infinity
    x = torch.from_numpy(rng.choice(finite, size=(ROWS, VOCAB)).view(np.int16)).view(torch.bfloat16)
    assert greedy_argmax(x).tolist() == _float_argmax(x).tolist()
    few = rng.choice(finite, size=40)  # 40 distinct values over 9,000 columns: the maximum repeats
    x = torch.from_numpy(rng.choice(few, size=(ROWS, VOCAB)).view(np.int16)).view(torch.bfloat16)
    assert greedy_argmax(x).tolist() == _float_argmax(x).tolist()


def test_layouts() -> None:
    x = _crafted()
    strided = torch.cat([x, x], dim=1)[:, 3 : 3 + VOCAB]  # rows not contiguous with each other
    assert greedy_argmax(strided).tolist() == _float_argmax(strided).tolist()
    with torch.inference_mode():
        y = x.clone()
        assert greedy_argmax(y).tolist() == _float_argmax(y).tolist()
    small = x[:2]  # under the threshold: the float32 copy and numpy's argmax
    assert greedy_argmax(small).tolist() == _float_argmax(small).tolist()
    assert greedy_argmax(x.half()).tolist() == _float_argmax(x.half()).tolist()
    out = greedy_argmax(x)
    out[0] = 3  # writable: random rows are written into the greedy result (Sampler.forward)
    assert out[0].item() == 3


def _state(params: list[SamplingParams]) -> SamplingState:
    state = SamplingState(len(params), VOCAB, 64, torch.device("cpu"))
    for row, p in enumerate(params):
        state.add_request(row, p, [1, 2, 3], [], None)
    return state


def _both(params: list[SamplingParams], logits: torch.Tensor):
    """The sampler over the bfloat16 logits and over their float32 copy (what compute_logits returned before),
    with equal fresh state (seeded generators start alike)."""
    rows = np.arange(len(params), dtype=np.int64)
    got = Sampler()(logits, _state(params).make_metadata(rows))
    want = Sampler()(logits.float(), _state(params).make_metadata(rows))
    return got, want


def test_all_greedy_batch_takes_the_int16_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = sampler_mod._argmax_bf16_cpu
    monkeypatch.setattr(sampler_mod, "_argmax_bf16_cpu", lambda t: calls.append(t.dtype) or real(t))
    logits = _crafted()
    got, want = _both([SamplingParams(temperature=0.0)] * ROWS, logits)
    assert calls == [torch.bfloat16]
    assert got.sampled_token_ids.tolist() == want.sampled_token_ids.tolist()
    assert got.logprobs_tensors is None


def test_batches_that_need_float32_get_its_results() -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(ROWS, VOCAB, generator=g) * 3).to(torch.bfloat16)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie in a greedy row
    greedy = SamplingParams(temperature=0.0)
    mixes = {
        "logprobs": [greedy] * (ROWS - 1) + [SamplingParams(temperature=0.0, logprobs=3)],
        "penalty": [greedy] * (ROWS - 1) + [SamplingParams(temperature=0.0, presence_penalty=1.5)],
        "bias": [greedy] * (ROWS - 1) + [SamplingParams(temperature=0.0, logit_bias={7: 100.0})],
        "random": [greedy] * (ROWS - 2) + [SamplingParams(temperature=0.8, seed=5, top_k=20)] * 2,
        "all random": [SamplingParams(temperature=1.0, seed=i) for i in range(ROWS)],
    }
    for name, params in mixes.items():
        got, want = _both(params, logits)
        assert got.sampled_token_ids.tolist() == want.sampled_token_ids.tolist(), name
        assert got.sampled_token_ids[0].item() == 5 or name == "all random", name
        if want.logprobs_tensors is None:
            assert got.logprobs_tensors is None, name
        else:
            assert got.logprobs_tensors is not None
            for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
                assert torch.equal(getattr(got.logprobs_tensors, field), getattr(want.logprobs_tensors, field)), name
    got, _ = _both(mixes["bias"], logits)
    assert got.sampled_token_ids[-1].item() == 7


def test_float64_logits_keep_their_own_argmax() -> None:
    """float64 values a float32 copy would merge (1 and 1 + 1e-12) keep float64's winner: no rounding first."""
    x = torch.zeros(2, 8, dtype=torch.float64)
    x[:, 2] = 1.0
    x[:, 5] = 1.0 + 1e-12
    assert greedy_argmax(x).tolist() == [5, 5]
