"""Gemma 3 (text) gives Hugging Face's float32 greedy tokens and logprobs past its sliding window.

The tiny build has a global layer every 3rd layer, different local/global RoPE bases (global one
linearly scaled), q/k norms, and no soft-capping; prompts run past TINY_WINDOW with prefix caching on.
"""

from __future__ import annotations

import pytest
import torch

from vllm_lite.testing.checkpoints import TINY_WINDOW, get_checkpoint
from vllm_lite.testing.hf_match import (
    assert_matches_hf_twice_with_prefix_caching,
    assert_multiprocess_matches_hf,
    hf_model_eager,
)
from vllm_lite.testing.hf_oracle import greedy_prompts
from vllm_lite.worker.models.gemma3 import layer_rope_parameters
from vllm_lite.worker.models.sliding_window import layer_sliding_windows

NEW_TOKENS = 10
PROMPT_LENS = (9, 40, 70)


def test_greedy_float32_matches_hf_past_the_window_with_prefix_caching(monkeypatch) -> None:
    assert max(PROMPT_LENS) > TINY_WINDOW
    assert_matches_hf_twice_with_prefix_caching(get_checkpoint("gemma3"), PROMPT_LENS, NEW_TOKENS, monkeypatch)


def test_multiprocess_matches_hf() -> None:
    assert_multiprocess_matches_hf(get_checkpoint("gemma3"), (40, 70), NEW_TOKENS)


def test_layer_kinds_and_rope_bases_follow_the_config() -> None:
    """Every 3rd layer global; sliding layers use the local base, global ones the scaled global base."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(get_checkpoint("gemma3"))
    w = TINY_WINDOW
    assert layer_sliding_windows(config) == [w, w, None, w]
    # The raw config.json the scheduler reads, without layer_types: the same answer from the pattern.
    assert layer_sliding_windows(
        {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": w, "sliding_window_pattern": 3}
    ) == [w, w, None, w, w, None, w]
    local, glob = layer_rope_parameters(config, "sliding_attention"), layer_rope_parameters(config, "full_attention")
    assert (local["rope_theta"], local["rope_type"]) == (10_000.0, "default")
    assert (glob["rope_theta"], glob["rope_type"], glob["factor"]) == (1_000_000.0, "linear", 8.0)


def test_bidirectional_gemma3_is_refused() -> None:
    from transformers import Gemma3TextConfig

    from vllm_lite.worker.models.gemma3 import Gemma3ForCausalLM

    cfg = Gemma3TextConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        vocab_size=64,
        use_bidirectional_attention=True,
    )
    with pytest.raises(ValueError, match="bidirectional"):
        Gemma3ForCausalLM(cfg)


def _hf_first_logprob_moves(prompt_len: int, edit_config) -> None:
    """HF's eager float32 model with edit_config(config) applied scores a prompt's next token otherwise than the
    checkpoint as it is."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vllm_lite.testing.hf_oracle import hf_greedy

    path = get_checkpoint("gemma3")
    prompt = greedy_prompts(AutoTokenizer.from_pretrained(path), (prompt_len,))[0]
    ref = hf_greedy(hf_model_eager(path), prompt, 1)
    config = AutoConfig.from_pretrained(path)
    edit_config(config)
    edited = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert abs(hf_greedy(edited, prompt, 1).logprobs[0] - ref.logprobs[0]) > 1e-4


def test_the_local_rope_base_matters_for_hf() -> None:
    """Not vacuous: HF with one base for both layer kinds scores the same prompt differently."""

    def one_base(config) -> None:
        config.rope_parameters["sliding_attention"] = dict(config.rope_parameters["full_attention"])

    _hf_first_logprob_moves(40, one_base)


def test_the_window_changes_hf_output_on_these_prompts() -> None:
    """The HF match above is not vacuous: without a binding window HF scores a 70-token prompt otherwise."""

    def no_window(config) -> None:
        config.sliding_window = 4096  # same layer kinds and rotations; only the window no longer binds

    _hf_first_logprob_moves(70, no_window)
