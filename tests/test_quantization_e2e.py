"""Greedy tokens of int4 models equal those of the same models with the weights dequantized to float32.

The float32 reference is the checkpoint's reference dequantization (testing/quantize.py) loaded as a plain
model; the int4 engine dequantizes its own layout per layer. Identical weights, identical F.linear calls:
the tokens must match exactly, in-process and with tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.quantize import get_dequantized_checkpoint, get_quantized_checkpoint

ENGINE_KW: dict[str, Any] = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256)
PROMPTS = [[5, 6, 7, 8, 9, 10], [300, 17, 1200], [42] * 20]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

CASES = {
    "llama-awq": ("llama", "awq", {}),
    "qwen2-gptq-actorder-asym": ("qwen2", "gptq", dict(desc_act=True, sym=False)),
}


def _greedy(path: str, **kw: Any) -> list[list[int]]:
    with LLM(path, **ENGINE_KW, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[str, list[list[int]]]]:
    """Per case: the int4 checkpoint and the float32 reference's greedy tokens (computed once)."""
    out = {}
    for case, (arch, method, kw) in CASES.items():
        path = get_quantized_checkpoint(arch, method, group_size=32, **kw)
        out[case] = (path, _greedy(get_dequantized_checkpoint(path), multiprocess=False))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_int4_greedy_tokens_equal_the_dequantized_float32_models(runs, case):
    path, want = runs[case]
    got = _greedy(path, multiprocess=False)
    assert got == want
    assert len({tuple(t) for t in got}) > 1  # the prompts do lead somewhere different


@pytest.mark.slow
def test_int4_under_tensor_parallel_2_matches_the_float32_model(runs):
    path, want = runs["qwen2-gptq-actorder-asym"]
    assert _greedy(path, tensor_parallel_size=2) == want
