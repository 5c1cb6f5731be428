"""End to end: `LLM.generate` on our own model code matches Hugging Face on the same weights."""

from __future__ import annotations

import functools

import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.hf_match import record_preemptions

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "opt"]
NEW_TOKENS = 32


def _prompts(tokenizer, n: int = 8) -> list[list[int]]:
    """Token-id prompts of different lengths, several longer than one 16-token block."""
    text = (
        "The for statement is used to iterate over the elements of a sequence such as a string, "
        "tuple or list, or other iterable object. The while statement is used for repeated execution "
        "as long as an expression is true. Exceptions are raised by the raise statement. "
    ) * 4
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    lengths = [3, 9, 17, 33, 48, 70, 5, 101][:n]
    return [ids[i : i + L] for i, L in enumerate(lengths)]


def hf_greedy(model_dir: str, prompt: list[int], n: int, dtype: torch.dtype) -> tuple[list[int], list[float]]:
    """Greedy continuation by Hugging Face with its KV cache, plus each chosen token's logprob.

    Memoised: the Qwen2 tests ask for the same continuations five times and HF's answer cannot change."""
    tokens, logprobs = _hf_greedy_cached(model_dir, tuple(prompt), n, dtype)
    return list(tokens), list(logprobs)


@functools.lru_cache(maxsize=None)
def _hf_greedy_cached(
    model_dir: str, prompt: tuple[int, ...], n: int, dtype: torch.dtype
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    model = _hf_model(model_dir, dtype)
    ids = torch.tensor([list(prompt)])
    out, logprobs = [], []
    past = None
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            lp = torch.log_softmax(res.logits[0, -1].float(), -1)
            tok = int(lp.argmax())
            out.append(tok)
            logprobs.append(float(lp[tok]))
            ids = torch.tensor([[tok]])
    return tuple(out), tuple(logprobs)


_HF_CACHE: dict = {}


def _hf_model(model_dir: str, dtype: torch.dtype):
    key = (model_dir, dtype)
    if key not in _HF_CACHE:
        from transformers import AutoModelForCausalLM

        _HF_CACHE.clear()
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return _HF_CACHE[key]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_float32_matches_hf_with_chunked_mixed_batches(arch: str) -> None:
    """Exact greedy tokens vs HF for 8 prompts; a 32-token budget forces chunked prefills mixed with decodes."""
    path = get_checkpoint(arch)
    llm = LLM(
        model=path, dtype="float32", multiprocess=False, max_num_batched_tokens=32, block_size=16, max_model_len=256
    )
    prompts = _prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # input order kept
    for p, o in zip(prompts, outs):
        want, _ = hf_greedy(path, p, NEW_TOKENS, torch.float32)
        assert o.outputs[0].token_ids == want, f"prompt of {len(p)} tokens diverged from HF"
        assert o.outputs[0].finish_reason == "length"
        assert o.finished
    # The same prompt alone gives the same tokens as inside the batch.
    alone = llm.generate({"prompt_token_ids": prompts[5]}, params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[5].outputs[0].token_ids
    llm.shutdown()


def test_bfloat16_logprobs_close_to_hf_bfloat16() -> None:
    """bf16 runs end to end; the chosen tokens' logprobs stay near HF's bf16 ones (ties may flip tokens)."""
    path = get_checkpoint("qwen2")
    llm = LLM(model=path, dtype="bfloat16", multiprocess=False, max_model_len=256)
    prompts = _prompts(llm.get_tokenizer(), 4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = _hf_model(path, torch.bfloat16)
    for p, o in zip(prompts, outs):
        toks = o.outputs[0].token_ids
        ours = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + toks])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) - 1 + len(toks)]
        theirs = ref.gather(1, torch.tensor(toks)[:, None])[:, 0]
        diff = (torch.tensor(ours) - theirs).abs()
        assert diff.mean() < 0.05 and diff.max() < 0.25, f"bf16 logprobs drift: {diff.tolist()}"
    llm.shutdown()


def test_text_prompts_and_request_output_fields() -> None:
    """String prompts tokenize, detokenize back, and every vLLM RequestOutput field is filled."""
    path = get_checkpoint("llama")
    llm = LLM(model=path, dtype="float32", multiprocess=False)
    outs = llm.generate(
        ["Hello, my name is", "The for statement"],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    tok = llm.get_tokenizer()
    for prompt, o in zip(["Hello, my name is", "The for statement"], outs):
        assert o.prompt == prompt
        assert o.prompt_token_ids == tok(prompt)["input_ids"]
        c = o.outputs[0]
        assert c.index == 0 and len(c.token_ids) == 8
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert o.metrics is not None and o.metrics.arrival_time <= o.metrics.first_token_time <= o.metrics.finished_time
    llm.shutdown()


@functools.lru_cache(maxsize=None)
def _kv_bytes_per_block(path: str, block_size: int) -> int:
    """Bytes of one KV block as the runner sizes it (float32); one engine start for every preemption case."""
    llm = LLM(model=path, dtype="float32", multiprocess=False, max_model_len=136, block_size=block_size)
    try:
        return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.kv_cache_bytes_per_block()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_hf_under_forced_preemption(mode: str, caching: bool, monkeypatch) -> None:
    """A KV cache so small that requests are preempted many times still gives HF's exact tokens."""
    path = get_checkpoint("qwen2")
    preempted = record_preemptions(monkeypatch)
    per_block = _kv_bytes_per_block(path, block_size=4)
    # 35 usable blocks of 4 tokens (one max_model_len sequence fits) for 8 requests growing to 35-133 tokens.
    llm = LLM(
        model=path,
        dtype="float32",
        multiprocess=False,
        max_model_len=136,
        block_size=4,
        max_num_batched_tokens=24,
        enable_prefix_caching=caching,
        preemption_mode=mode,
        kv_cache_memory_bytes=per_block * 36,
        swap_space=per_block * 200 / (1 << 30),
    )
    prompts = _prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(preempted) >= 5, f"only {len(preempted)} preemptions: the cache was not small enough"
    for p, o in zip(prompts, outs):
        want, _ = hf_greedy(path, p, NEW_TOKENS, torch.float32)
        assert o.outputs[0].token_ids == want, f"prompt of {len(p)} tokens diverged from HF under preemption"
    assert llm.llm_engine.call_utility("get_num_free_blocks") == llm.llm_engine.call_utility("get_num_total_blocks")
    llm.shutdown()
