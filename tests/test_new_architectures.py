"""Phi-3, GPT-2, Gemma 2 and windowed Mistral/Qwen2 give Hugging Face's float32 greedy tokens and logprobs.

Prompts run past the tiny builds' sliding window (TINY_WINDOW tokens), prefix caching is on and
each batch runs twice (the second time from cached prefix blocks), and the KV blocks one sequence
of an all-windowed model holds stay bounded by its window.
"""

from __future__ import annotations

import pytest

from vllm_lite import LLM
from vllm_lite.testing.checkpoints import TINY_WINDOW, get_checkpoint
from vllm_lite.testing.hf_match import (
    assert_matches_hf,
    assert_matches_hf_twice_with_prefix_caching,
    assert_multiprocess_matches_hf,
    generate_greedy,
    hf_model_eager,
    record_preemptions,
    record_prefix_hits,
)
from vllm_lite.testing.hf_oracle import greedy_prompts, hf_greedy
from vllm_lite.worker.models.sliding_window import (
    layer_sliding_windows,
    uniform_sliding_window,
)

NEW_TOKENS = 10
PROMPT_LENS = (9, 40, 70)  # two of them longer than the window
ARCHS = ["phi3", "gpt2", "gemma2", "mistral_sw", "qwen2_sw"]


@pytest.fixture
def prefix_hits(monkeypatch) -> list[int]:
    """Hit tokens of every prefix-cache lookup the scheduler records (its stats reset them each step)."""
    return record_prefix_hits(monkeypatch)


def _generate(llm: LLM, prompts: list[list[int]]):
    return generate_greedy(llm, prompts, NEW_TOKENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_float32_matches_hf_past_the_window_with_prefix_caching(arch: str, monkeypatch) -> None:
    """Chunked prefills mixed with decodes, then the same prompts again from the prefix cache."""
    assert_matches_hf_twice_with_prefix_caching(get_checkpoint(arch), PROMPT_LENS, NEW_TOKENS, monkeypatch)


@pytest.mark.parametrize("arch", ["mistral_sw", "qwen2_sw", "gemma2"])
def test_the_window_changes_hf_output_on_these_prompts(arch: str) -> None:
    """The tests above are not vacuous: the same weights without the window give other logprobs."""
    path = get_checkpoint(arch)
    assert max(PROMPT_LENS) > TINY_WINDOW
    assert any(w == TINY_WINDOW for w in layer_sliding_windows(hf_model_eager(path).config))
    from transformers import AutoTokenizer

    prompt = greedy_prompts(AutoTokenizer.from_pretrained(path), (70,))[0]
    windowed = hf_greedy(hf_model_eager(path), prompt, 3)
    hf_model_eager.cache_clear()
    n = hf_model_eager(path).config.num_hidden_layers
    no_window = {"sliding_window": None} if arch == "mistral_sw" else {"layer_types": ("full_attention",) * n}
    full = hf_greedy(hf_model_eager(path, **no_window), prompt, 3)
    hf_model_eager.cache_clear()
    assert abs(windowed.logprobs[0] - full.logprobs[0]) > 1e-3 or windowed.tokens != full.tokens


def test_which_layers_are_windowed_follows_transformers() -> None:
    """Mistral: all layers (so its blocks can be freed); Qwen2: from max_window_layers; Gemma 2: alternating."""
    from transformers import AutoConfig

    mistral = AutoConfig.from_pretrained(get_checkpoint("mistral_sw"))
    qwen2 = AutoConfig.from_pretrained(get_checkpoint("qwen2_sw"))
    gemma2 = AutoConfig.from_pretrained(get_checkpoint("gemma2"))
    w = TINY_WINDOW
    assert layer_sliding_windows(mistral) == [w, w, w] and uniform_sliding_window(mistral) == w
    assert layer_sliding_windows(qwen2) == [None, w, w] and uniform_sliding_window(qwen2) is None
    assert layer_sliding_windows(gemma2) == [w, None, w, None] and uniform_sliding_window(gemma2) is None
    # The same answers from the raw config.json dicts the scheduler reads, without layer_types.
    assert layer_sliding_windows(
        {
            "model_type": "qwen2",
            "num_hidden_layers": 3,
            "sliding_window": w,
            "use_sliding_window": True,
            "max_window_layers": 2,
        }
    ) == [None, None, w]
    assert layer_sliding_windows(
        {"model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": w, "use_sliding_window": False}
    ) == [None, None]
    assert layer_sliding_windows({"model_type": "gemma2", "num_hidden_layers": 3, "sliding_window": w}) == [w, None, w]
    assert uniform_sliding_window({"model_type": "llama", "num_hidden_layers": 2}) is None


def _windowed_llm(path: str, block_size: int, budget: int, **extra) -> LLM:
    """An in-process float32 engine with small blocks and steps, so a 256-token max_model_len spans many windows."""
    return LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=block_size,
        max_model_len=256,
        max_num_batched_tokens=budget,
        **extra,
    )


def test_blocks_in_use_per_sequence_stay_within_the_window(monkeypatch) -> None:
    """All-windowed Mistral: blocks behind the window go back to the pool while the sequence grows."""
    from vllm_lite.core.sched.scheduler import Scheduler

    path = get_checkpoint("mistral_sw")
    block_size, budget = 4, 8
    peak: dict[str, int] = {}
    original = Scheduler.schedule

    def recording(self):
        out = original(self)
        kv = self.kv_cache_manager
        for req in self.running:
            peak[req.request_id] = max(peak.get(req.request_id, 0), kv.num_blocks_in_use(req.request_id))
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    with _windowed_llm(path, block_size, budget, enable_prefix_caching=True) as llm:
        prompts = greedy_prompts(llm.get_tokenizer(), (70, 40))
        outs = _generate(llm, prompts)
        assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.sliding_window == TINY_WINDOW
    # Blocks from the window's first block through this step's last token, plus one partial block.
    bound = -(-(TINY_WINDOW + budget) // block_size) + 1
    full = -(-(max(len(p) for p in prompts) + NEW_TOKENS) // block_size)
    assert peak and max(peak.values()) <= bound < full, (peak, bound, full)
    assert_matches_hf(path, prompts, outs)


def test_window_saved_kv_admits_sequences_longer_than_the_cache() -> None:
    """All-windowed Mistral: a cache of 19 blocks (76 tokens) serves two 70- and 40-token prompts at once, exactly.

    Without the window bound, a 256-token max_model_len needs 65 blocks and the engine refuses to start."""
    path = get_checkpoint("mistral_sw")
    block_size, budget = 4, 8
    per_block = 2 * block_size * 3 * 2 * 16 * 4  # K and V, 3 layers x 2 KV heads x 16 dims, float32
    bound = -(-(TINY_WINDOW - 1 + budget) // block_size) + 1
    with _windowed_llm(path, block_size, budget, kv_cache_memory_bytes=per_block * (2 * bound + 1)) as llm:
        assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.num_blocks == 2 * bound + 1
        prompts = greedy_prompts(llm.get_tokenizer(), (70, 40))
        outs = _generate(llm, prompts)
    assert (2 * bound + 1) * block_size < max(len(p) for p in prompts) + NEW_TOKENS  # the cache < one sequence
    assert_matches_hf(path, prompts, outs)


def test_prefix_hit_after_out_of_window_blocks_were_freed_and_evicted(prefix_hits: list[int]) -> None:
    """Freed out-of-window blocks keep their hashes until evicted; hits before and after eviction stay exact."""
    path = get_checkpoint("mistral_sw")
    # 40 blocks of 4 tokens: K and V, 3 layers x 2 KV heads x 16 dims in float32 per token.
    per_block = 2 * 4 * 3 * 2 * 16 * 4
    with LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=4,
        max_model_len=128,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=per_block * 40,
    ) as llm:
        kv = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
        assert kv.num_total_blocks < 45
        tok = llm.get_tokenizer()
        base = greedy_prompts(tok, (70,))[0]
        branch = base[:60] + base[:5]  # shares 15 full blocks with base, then differs
        _generate(llm, [base])
        prefix_hits.clear()
        hit_outs = _generate(llm, [branch])  # blocks freed behind the window are still cached
        hits = sum(prefix_hits)
        assert hits >= 40, f"expected a long prefix hit on blocks freed behind the window, got {hits} tokens"
        # Other sequences recycle the pool, evicting the freed prefix blocks (least recently used first).
        for shift in (1, 2, 3):
            _generate(llm, [[(t + shift) % 1000 + 10 for t in base]])
        prefix_hits.clear()
        evicted_outs = _generate(llm, [branch])
        hits_after = sum(prefix_hits)
        assert hits_after < hits, "the filler requests should have evicted part of the cached prefix"
    assert_matches_hf(path, [branch], hit_outs)
    assert_matches_hf(path, [branch], evicted_outs)


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "gpt2"])
def test_multiprocess_matches_hf(arch: str) -> None:
    """The engine core in its own process gives the same exact tokens (gemma2: the mixed-window model)."""
    assert_multiprocess_matches_hf(get_checkpoint(arch), (40, 70), NEW_TOKENS)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_windowed_model_under_preemption_matches_hf(mode: str, monkeypatch) -> None:
    """All-windowed, a cache of one max_model_len sequence: eight requests recycling blocks behind their
    windows still preempt one another (recompute or swap, null placeholders included) and stay exact."""
    preempted = record_preemptions(monkeypatch)
    path = get_checkpoint("mistral_sw")
    per_block = 2 * 4 * 3 * 2 * 16 * 4  # K and V, 3 layers x 2 KV heads x 16 dims, float32, 4 tokens
    # Decodes free a block behind the window as often as they open one: long prefill chunks make the pressure.
    with LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=4,
        max_model_len=96,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
        preemption_mode=mode,
        kv_cache_memory_bytes=per_block * 26,
        swap_space=per_block * 200 / (1 << 30),
    ) as llm:
        prompts = greedy_prompts(llm.get_tokenizer(), (70, 66, 60, 48, 72, 52, 64, 58))
        outs = _generate(llm, prompts)
    assert preempted, "eight windowed requests in 25 blocks should preempt one another"
    assert_matches_hf(path, prompts, outs)
