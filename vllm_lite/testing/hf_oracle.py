"""Hugging Face transformers as the greedy oracle on any device, and how to compare our greedy output with it.

Random tiny checkpoints are close to uniform, so two next tokens can be nearly tied; a divergence
where the oracle's top two log-probabilities are closer than the comparison tolerance is a tie
(either token is a correct greedy choice within float32 rounding), not a mismatch, and the tokens
after it are not comparable.
"""

from __future__ import annotations

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


def load_hf_model(model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> GreedyRun:
    """Greedy continuation by Hugging Face with its KV cache, on the model's device, logits in float32."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    run = GreedyRun([], [], [])
    past = None
    for _ in range(n):
        res = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        lp = torch.log_softmax(res.logits[0, -1].float(), -1)
        top = lp.topk(2)
        tok = int(top.indices[0])
        run.tokens.append(tok)
        run.logprobs.append(float(top.values[0]))
        run.gaps.append(float(top.values[0] - top.values[1]))
        ids = torch.tensor([[tok]], device=device)
    return run


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
