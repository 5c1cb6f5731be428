"""Hugging Face transformers as the greedy oracle on any device, and how to compare our greedy output with it.

Random tiny checkpoints are close to uniform, so two next tokens can be nearly tied; a divergence
where the oracle's top two log-probabilities are closer than the comparison tolerance is a tie
(either token is a correct greedy choice within float32 rounding), not a mismatch, and the tokens
after it are not comparable.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch

PROMPT_TEXT = (
    "The for statement is used to iterate over the elements of a sequence such as a string, "
    "tuple or list, or other iterable object. The while statement is used for repeated execution "
    "as long as an expression is true. Exceptions are raised by the raise statement. "
) * 4


def greedy_prompts(tokenizer: Any, lengths: Sequence[int] = (3, 9, 17, 33, 48, 70)) -> list[list[int]]:
    """Token-id prompts of different lengths, several longer than one 16-token block."""
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    return [ids[i : i + n] for i, n in enumerate(lengths)]


@dataclass
class GreedyRun:
    """Greedy tokens, each chosen token's log-probability, and (oracle only) each step's top-2 gap."""

    tokens: list[int]
    logprobs: list[float]
    gaps: Optional[list[float]] = None


def soft_caps_attention(config: Any) -> bool:
    """Whether a transformers config soft-caps attention logits (Gemma 2): only eager attention applies the cap."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "attn_logit_softcapping", None) is not None


def load_hf_model(model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """transformers' model for model_dir, with eager attention where the model soft-caps attention logits.

    transformers' sdpa (and flash) attention ignore attn_logit_softcapping; which implementation it picks by
    default depends on its version (5.24 picks eager for Gemma 2, 5.17 sdpa, on CPU and CUDA alike), so ask.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"attn_implementation": "eager"} if soft_caps_attention(AutoConfig.from_pretrained(model_dir)) else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra).to(device).eval()


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> GreedyRun:
    """Greedy continuation by Hugging Face with its KV cache, on the model's device, logits in float32.

    For a model whose rotation switches with the sequence's length (Phi-3 LongRoPE; rope_regime.py), the cache
    is dropped and the whole sequence recomputed at the step the sequence first grows past the switch, as
    Phi3ForCausalLM.prepare_inputs_for_generation intends generate() to do (and transformers 5.24's does).
    """
    from vllm_lite.worker.models.rope_regime import rope_recompute_at

    device = next(model.parameters()).device
    switch = rope_recompute_at(model.config)
    cache_kw = _cache_kwarg(model)
    seq = list(prompt)
    ids = torch.tensor([seq], device=device)
    run = GreedyRun([], [], [])
    past = None
    for _ in range(n):
        if switch is not None and past is not None and len(seq) > switch >= past.get_seq_length():
            past, ids = None, torch.tensor([seq], device=device)  # the regime switch: recompute everything
        res = model(input_ids=ids, use_cache=True, **{cache_kw: past})
        past = getattr(res, cache_kw)
        lp = torch.log_softmax(res.logits[0, -1].float(), -1)
        top = lp.topk(2)
        tok = int(top.indices[0])
        run.tokens.append(tok)
        run.logprobs.append(float(top.values[0]))
        run.gaps.append(float(top.values[0] - top.values[1]))
        seq.append(tok)
        ids = torch.tensor([[tok]], device=device)
    return run


@functools.lru_cache(maxsize=1)
def generate_recomputes_at_rope_switch() -> bool:
    """Feature test: does the installed transformers' Phi-3 generate() recompute the whole sequence at the switch?

    Phi3ForCausalLM.prepare_inputs_for_generation drops the cache at the step the sequence first grows past
    original_max_position_embeddings. transformers 5.24 then runs the whole sequence; 5.17 still feeds only the
    newest token (generate()'s next_sequence_length stays 1), at position 0 with nothing before it, and drops
    the one-token cache again every later step, so each later token is predicted from the previous token alone.
    This generates with a throwaway 1-layer LongRoPE Phi-3 (original context 4) and looks at what the step
    after the crossing was fed. The global RNG is restored after the random init.
    """
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        original_max_position_embeddings=4,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        model = Phi3ForCausalLM(config).eval()
    fed: list[int] = []
    hook = model.model.register_forward_pre_hook(
        lambda _m, args, kwargs: fed.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]),
        with_kwargs=True,
    )
    try:
        with torch.no_grad():  # prompt 3: steps see 3 (prefill), 4 (cached), 5 (past 4: the recompute), 6
            model.generate(
                torch.tensor([[3, 4, 5]]), do_sample=False, max_new_tokens=4, min_new_tokens=4, eos_token_id=None
            )
    finally:
        hook.remove()
    return fed[:4] == [3, 1, 5, 1]


def hf_generate_greedy(model: torch.nn.Module, prompt: Sequence[int], n: int) -> GreedyRun:
    """transformers' generate() (greedy, EOS ignored): its tokens and each chosen token's float32 logprob.

    Where the model switches rope regime with length and the installed generate() does not recompute at the
    switch (generate_recomputes_at_rope_switch), hf_greedy, which does, stands in for it.
    """
    from vllm_lite.worker.models.rope_regime import rope_recompute_at

    if rope_recompute_at(model.config) is not None and not generate_recomputes_at_rope_switch():
        return hf_greedy(model, list(prompt), n)
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n, min_new_tokens=n)
    config.update(output_logits=True, return_dict_in_generate=True)
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)], device=device), generation_config=config)
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
    return GreedyRun(tokens, logprobs)


@dataclass
class Agreement:
    """How one greedy run agrees with the oracle's."""

    tokens: int  # tokens compared
    matched_prefix: int  # tokens equal before the first divergence
    diverged_at: Optional[int]  # index of the first differing token, None if all equal
    tie: bool  # the divergence is at a step where the oracle's top two are within tie_tol
    max_logprob_err: float  # over the matched prefix

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_greedy(ours: GreedyRun, oracle: GreedyRun, tie_tol: float) -> Agreement:
    """Token-by-token agreement up to the first divergence, and the worst chosen-token logprob error there."""
    n = min(len(ours.tokens), len(oracle.tokens))
    matched = 0
    while matched < n and ours.tokens[matched] == oracle.tokens[matched]:
        matched += 1
    diverged = None if matched == n and len(ours.tokens) == len(oracle.tokens) else matched
    tie = diverged is not None and diverged < n and oracle.gaps is not None and oracle.gaps[diverged] < tie_tol
    errs = [abs(a - b) for a, b in zip(ours.logprobs[:matched], oracle.logprobs[:matched])]
    return Agreement(n, matched, diverged, tie, max(errs, default=0.0))
