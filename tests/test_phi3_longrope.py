"""Phi-3 LongRoPE (the 128k-context variants) gives Hugging Face's float32 greedy tokens and logprobs.

The tiny build's original_max_position_embeddings is 32, so one batch holds a prompt that stays under it
(short factors throughout), one whose decode crosses it (long factors from the step its sequence passes 32),
and one longer than it (long factors from the first token); each request picks its factors by its own
sequence length, as transformers' dynamic LongRoPE does for one sequence. The oracle is transformers' model
stepped with its KV cache (hf_oracle.hf_greedy).
"""

from __future__ import annotations

import pytest

from vllm_lite import LLM
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.hf_match import assert_matches_hf, generate_greedy
from vllm_lite.testing.hf_oracle import greedy_prompts

ORIGINAL_MAX = 32  # the phi3_longrope build's original_max_position_embeddings
NEW_TOKENS = 12
PROMPT_LENS = (9, 26, 45)  # under it throughout; crossing it while decoding; over it from the start


@pytest.fixture(scope="module")
def path() -> str:
    return get_checkpoint("phi3_longrope")


def test_greedy_matches_hf_under_across_and_past_the_original_context(path: str) -> None:
    with LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=8,
        max_model_len=128,
        enable_prefix_caching=True,
    ) as llm:
        prompts = greedy_prompts(llm.get_tokenizer(), PROMPT_LENS)
        outs = generate_greedy(llm, prompts, NEW_TOKENS)
    lens = [len(p) for p in prompts]
    assert lens[0] + NEW_TOKENS <= ORIGINAL_MAX < lens[1] + NEW_TOKENS and lens[1] < ORIGINAL_MAX < lens[2]
    assert_matches_hf(path, prompts, outs)


def test_factor_lists_of_the_wrong_length_are_refused() -> None:
    from transformers import Phi3Config

    from vllm_lite.worker.models.phi3 import Phi3ForCausalLM

    cfg = Phi3Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=256,
        original_max_position_embeddings=32,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    )
    cfg.rope_parameters["short_factor"] = [1.0] * 3  # transformers validates at construction; break it after
    with pytest.raises(ValueError, match="short_factor must have 8 entries"):
        Phi3ForCausalLM(cfg)
