"""Phi-3 LongRoPE (the 128k-context variants) gives Hugging Face generate()'s float32 greedy tokens and logprobs.

The tiny build's original_max_position_embeddings is 32. transformers' Phi-3 rotates a sequence of at most 32
tokens with the short factors and a longer one with the long factors, and its generate() drops the KV cache and
recomputes the whole sequence at the step the sequence first grows past 32. So the oracle is generate() itself
(not the model stepped with its cache, which keeps the short-rotated keys), or where the installed generate() does
not recompute there (transformers 5.17: it feeds only the newest token, see hf_oracle), hf_greedy, which steps
the model and recomputes at the switch as generate() is meant to (checked against generate() where it does): one engine with a small
max_num_batched_tokens (long prompts run in chunks) and prefix caching on must give its tokens exactly and its
chosen-token logprobs within 1e-4 for a prompt that stays under 32, one whose decode crosses it, one longer than
it, and a long prompt that shares a prefix with an earlier short request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from vllm_lite import LLM
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.hf_match import as_greedy_run, generate_greedy, hf_model_eager, record_preemptions
from vllm_lite.testing.hf_oracle import PROMPT_TEXT, hf_generate_greedy

ORIGINAL_MAX = 32  # the phi3_longrope build's original_max_position_embeddings
NEW_TOKENS = 12
BUDGET = 16  # max_num_batched_tokens: a 45-token prompt runs in three chunks, the first two under 32 tokens
TOL = 1e-4


@pytest.fixture(scope="module")
def path() -> str:
    return get_checkpoint("phi3_longrope")


@pytest.fixture(scope="module")
def llm(path: str) -> Iterator[LLM]:
    with LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=True,
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def text_ids(llm: LLM) -> list[int]:
    return llm.get_tokenizer()(PROMPT_TEXT, add_special_tokens=False)["input_ids"]


def assert_equals_hf_generate(path: str, prompts: Sequence[Sequence[int]], outs: Sequence[Any]) -> None:
    for prompt, out in zip(prompts, outs):
        ours, hf = as_greedy_run(out), hf_generate_greedy(hf_model_eager(path), prompt, NEW_TOKENS)
        assert ours.tokens == hf.tokens, f"prompt of {len(prompt)} tokens"
        err = max(abs(a - b) for a, b in zip(ours.logprobs, hf.logprobs))
        assert err < TOL, f"prompt of {len(prompt)} tokens: logprob error {err}"


def test_decode_crossing_the_original_context_recomputes_like_hf_generate(
    llm: LLM, path: str, text_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 26-token prompt grows past 32 at its 7th token: from there HF recomputes every token with the long set."""
    preemptions = record_preemptions(monkeypatch)
    prompts = [text_ids[1:27], text_ids[3:12]]  # crosses while decoding; stays under 32 throughout
    assert len(prompts[0]) < ORIGINAL_MAX < len(prompts[0]) + NEW_TOKENS
    assert len(prompts[1]) + NEW_TOKENS <= ORIGINAL_MAX
    assert_equals_hf_generate(path, prompts, generate_greedy(llm, prompts, NEW_TOKENS))
    assert preemptions == []  # the crossing's recompute is not a preemption


def test_chunked_prompt_longer_than_the_original_context_uses_the_long_set_throughout(
    llm: LLM, path: str, text_ids: list[int]
) -> None:
    """Every chunk of a 45-token prompt (16 tokens a step) is rotated with the long set, as HF's one forward is."""
    prompts = [text_ids[5:50]]
    assert len(prompts[0]) > ORIGINAL_MAX > BUDGET
    assert_equals_hf_generate(path, prompts, generate_greedy(llm, prompts, NEW_TOKENS))


def test_prefix_cache_keeps_the_short_and_long_regimes_apart(
    llm: LLM, path: str, text_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt never reuses the short-rotated keys of an earlier short request with the same prefix, yet a
    second long prompt with that prefix does hit the first one's (long-rotated) blocks."""
    from vllm_lite.testing.hf_match import record_prefix_hits

    short, long_a, long_b = text_ids[60:84], text_ids[60:110], text_ids[60:100] + text_ids[7:15]
    generate_greedy(llm, [short], 4)  # 24 + 4 tokens: short factors throughout, its blocks cached
    hits = record_prefix_hits(monkeypatch)
    outs = [generate_greedy(llm, [p], NEW_TOKENS)[0] for p in (long_a, long_b)]
    assert hits[0] == 0, "the long prompt reused blocks written with the short factors"
    assert hits[1] >= 40, "the second long prompt missed the first one's long-regime blocks"
    assert_equals_hf_generate(path, [long_a, long_b], outs)


def test_prompt_logprobs_come_once_across_the_recompute(llm: LLM, text_ids: list[int]) -> None:
    """The crossing's recompute runs the prompt again; its prompt logprobs were already sent and are not resent."""
    from vllm_lite import SamplingParams

    prompt = text_ids[1:27]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert len(prompt) + 8 > ORIGINAL_MAX and len(out.outputs[0].token_ids) == 8
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)


def test_the_stand_in_oracle_recomputes_at_the_switch_as_generate_does(
    path: str, text_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf_greedy stands in for generate() where the installed transformers' does not recompute at the switch: it
    gives generate()'s result where generate() does, and not the model's stepped with its cache throughout."""
    from vllm_lite.testing.hf_oracle import generate_recomputes_at_rope_switch, hf_greedy
    from vllm_lite.worker.models import rope_regime

    model, prompt = hf_model_eager(path), text_ids[1:27]
    stand_in = hf_greedy(model, prompt, NEW_TOKENS)
    if generate_recomputes_at_rope_switch():
        hf = hf_generate_greedy(model, prompt, NEW_TOKENS)
        assert stand_in.tokens == hf.tokens
        assert max(abs(a - b) for a, b in zip(stand_in.logprobs, hf.logprobs)) < TOL
    monkeypatch.setattr(rope_regime, "rope_recompute_at", lambda config: None)
    stepped = hf_greedy(model, prompt, NEW_TOKENS)  # keeps the short-rotated keys past the switch
    assert stepped.tokens[:6] == stand_in.tokens[:6]  # the same up to the switch
    assert (
        stepped.tokens != stand_in.tokens
        or max(abs(a - b) for a, b in zip(stepped.logprobs[6:], stand_in.logprobs[6:])) > 1e-3
    )


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


def test_only_phi3_longrope_configs_switch_regime() -> None:
    """The scheduler's recompute is gated on this: every other model (and Phi-3 without LongRoPE) gets None."""
    from vllm_lite.worker.models.rope_regime import rope_recompute_at

    longrope = {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0], "original_max_position_embeddings": 32}
    assert rope_recompute_at({"model_type": "phi3", "rope_parameters": longrope}) == 32
    assert (
        rope_recompute_at(
            {"model_type": "phi3", "rope_scaling": {"type": "su"}, "original_max_position_embeddings": 64}
        )
        == 64
    )
    assert rope_recompute_at({"model_type": "phi3", "rope_parameters": {"rope_type": "default"}}) is None
    assert rope_recompute_at({"model_type": "llama", "rope_parameters": longrope}) is None
