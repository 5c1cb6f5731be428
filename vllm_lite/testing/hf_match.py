"""Run our engine greedily with logprobs and assert it gives Hugging Face's float32 tokens and logprobs.

Shared by the per-architecture tests (Gemma 2/3, Phi-3, GPT-2, the windowed and MoE models); the oracle itself is hf_oracle.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from vllm_lite.testing.hf_oracle import GreedyRun, compare_greedy, hf_greedy


@functools.lru_cache(maxsize=1)
def hf_model_eager(path: str, **overrides: Any) -> torch.nn.Module:
    """transformers' float32 model with eager attention (the one that implements windows and soft-caps).

    `overrides` change the config (tuples, hashable for the cache, become lists), e.g. to drop a window.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(
        path, **{k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}
    )
    return AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def generate_greedy(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Any]:
    from vllm_lite import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)


def assert_multiprocess_matches_hf(path: str, prompt_lens: Sequence[int], max_tokens: int) -> None:
    """The engine core in its own process (the msgpack wire, logprobs as raw frames) still gives HF's tokens."""
    from vllm_lite import LLM
    from vllm_lite.testing.hf_oracle import greedy_prompts

    with LLM(model=path, dtype="float32", multiprocess=True, block_size=16, max_model_len=256) as llm:
        prompts = greedy_prompts(llm.get_tokenizer(), prompt_lens)
        outs = generate_greedy(llm, prompts, max_tokens)
    assert_matches_hf(path, prompts, outs)


def assert_matches_hf_twice_with_prefix_caching(
    path: str,
    prompt_lens: Sequence[int],
    max_tokens: int,
    monkeypatch: Any,
    check_engine: Optional[Callable[[Any], None]] = None,
    **llm_args: Any,
) -> None:
    """In process, float32, 8-token blocks and 32-token steps (chunked prefills beside decodes), prefix caching
    on: the prompts, then the same prompts again, which must start from cached prefix blocks; both passes give
    HF's tokens. check_engine(llm), when given, looks at the engine before it generates; llm_args add to LLM's."""
    from vllm_lite import LLM
    from vllm_lite.testing.hf_oracle import greedy_prompts

    hits = record_prefix_hits(monkeypatch)
    with LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        block_size=8,
        max_model_len=256,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        **llm_args,
    ) as llm:
        if check_engine is not None:
            check_engine(llm)
        prompts = greedy_prompts(llm.get_tokenizer(), prompt_lens)
        first = generate_greedy(llm, prompts, max_tokens)
        hits.clear()
        again = generate_greedy(llm, prompts, max_tokens)  # from cached prefix blocks
    assert sum(hits) > 0, "the second pass should start from cached prefix blocks"
    assert_matches_hf(path, prompts, first)
    assert_matches_hf(path, prompts, again)


def as_greedy_run(output: Any) -> GreedyRun:
    toks = list(output.outputs[0].token_ids)
    return GreedyRun(toks, [lp[t].logprob for lp, t in zip(output.outputs[0].logprobs, toks)])


def assert_matches_hf(path: str, prompts: Sequence[Sequence[int]], outs: Sequence[Any], tol: float = 1e-4) -> None:
    """Tokens identical up to a near-tie of HF's top two (see hf_oracle), chosen-token logprobs within tol."""
    hf = hf_model_eager(path)
    for p, o in zip(prompts, outs):
        ours = as_greedy_run(o)
        agree = compare_greedy(ours, hf_greedy(hf, list(p), len(ours.tokens)), tol)
        assert agree.diverged_at is None or agree.tie, f"prompt of {len(p)} tokens: {agree}"
        assert agree.max_logprob_err < tol, f"prompt of {len(p)} tokens: {agree}"


def record_prefix_hits(monkeypatch: Any) -> list[int]:
    """Hit tokens of every prefix-cache lookup from now on (patched through pytest's monkeypatch, so undone)."""
    from vllm_lite.core.kv_cache_manager import KVCacheManager

    log: list[int] = []
    original = KVCacheManager.record_prefix_cache_lookup

    def recording(self: Any, num_queried_tokens: int, num_hit_tokens: int) -> None:
        log.append(num_hit_tokens)
        original(self, num_queried_tokens, num_hit_tokens)

    monkeypatch.setattr(KVCacheManager, "record_prefix_cache_lookup", recording)
    return log


def record_preemptions(monkeypatch: Any) -> list[str]:
    """Request ids the scheduler preempts from now on, in order (patched through monkeypatch, so undone)."""
    from vllm_lite.core.sched.scheduler import Scheduler

    log: list[str] = []
    original = Scheduler._preempt

    def recording(self: Any, req: Any, swap_out: Any) -> None:
        log.append(req.request_id)
        original(self, req, swap_out)

    monkeypatch.setattr(Scheduler, "_preempt", recording)
    return log
