"""The batched sampler: logits processors, then greedy or random sampling, plus logprobs.

Order follows vLLM V1: allowed-token mask, bans (bad words, min_tokens stop
ids), logit bias -> repetition/frequency/presence penalties -> (greedy rows:
argmax here) -> temperature -> min-p -> top-k -> top-p -> sample with the
exponential race (argmax of probs / Exponential(1)), which equals drawing from
the categorical distribution but needs no cumulative sum and lets seeded rows
draw their noise from their own generator. Every step works on the whole batch
at once; features no row uses are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vllm_lite.worker.sampling_metadata import SamplingMetadata
from vllm_lite.worker.step import LogprobsTensors

_NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [N]
    # [N, max_k+1], column 0 = sampled token; None if no row asked for logprobs.
    logprobs_tensors: Optional[LogprobsTensors]


# ---------------------------------------------------------------------- processors
def apply_allowed_and_bans(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Confine rows with allowed_token_ids, then ban bad words / held-back stop ids (in place)."""
    if md.allowed_rows is not None and md.allowed_index is not None:
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[md.allowed_index] = True
        logits.masked_fill_(md.allowed_rows.unsqueeze(1) & ~allowed, _NEG_INF)
    if md.banned_index is not None:
        logits[md.banned_index] = _NEG_INF
    return logits


def apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.logit_bias_index is not None and md.logit_bias_values is not None:
        logits.index_put_(md.logit_bias_index, md.logit_bias_values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF: over prompt+output, divide positive / multiply negative), then OpenAI frequency/presence."""
    if md.output_token_counts is None:
        return logits
    assert md.prompt_token_mask is not None and md.repetition_penalties is not None
    assert md.frequency_penalties is not None and md.presence_penalties is not None
    counts = md.output_token_counts
    seen_out = counts > 0
    rep = md.repetition_penalties.unsqueeze(1)
    seen = md.prompt_token_mask | seen_out
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits -= md.frequency_penalties.unsqueeze(1) * counts
    logits -= md.presence_penalties.unsqueeze(1) * seen_out
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], max_top_k: int, top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Keep the k best (ties kept), then the smallest set whose mass reaches p (as HF's warpers chained)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        assert top_k is not None
        # Only top-k: a partial topk is much cheaper than a full sort.
        best = torch.topk(logits, max_top_k, dim=-1).values
        kth = best.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = kth.masked_fill_((top_k >= vocab).unsqueeze(1), _NEG_INF)
        return logits.masked_fill_(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(max=vocab)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the best token
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(p / E), E ~ Exp(1) i.i.d., picks token i with probability p_i."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for i, gen in generators.items():  # seeded rows draw from their own stream, independent of the batch
        noise[i].exponential_(generator=gen)
    return probs.div_(noise).argmax(dim=-1)


# ---------------------------------------------------------------------- logprobs
def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Top-`num_logprobs` plus the given token in column 0, with that token's rank (1 = best)."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_vals, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        vals = torch.cat([chosen, top_vals], dim=1)
    else:
        ids, vals = token_ids, chosen
    return LogprobsTensors(ids, vals.to(torch.float32), ranks.to(torch.int64))


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of known next tokens (prompt_logprobs): logits [M, V], targets [M]."""
    if logits.dim() != 2 or target_token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [M, V] and target_token_ids [M], got {tuple(logits.shape)} and "
            f"{tuple(target_token_ids.shape)}."
        )
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs!r}.")
    k = min(num_logprobs, logits.shape[1])
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_token_ids, k)


# ---------------------------------------------------------------------- sampler
class Sampler(torch.nn.Module):
    """Turns a batch of logits into one token per row, honouring each row's SamplingParams."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(f"logits must be [{md.num_rows}, V], got {tuple(logits.shape)}.")
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        logits = self.apply_logits_processors(logits, md)
        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy = None if md.all_random else logits.argmax(dim=-1)
            logits = self.apply_sampling_warpers(logits, md)
            sampled = random_sample(logits.softmax(dim=-1), md.generators)
            if greedy is not None:
                assert md.greedy_mask is not None
                sampled = torch.where(md.greedy_mask, greedy, sampled)

        lp = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            lp = gather_logprobs(raw_logprobs, sampled, min(md.max_num_logprobs, logits.shape[1]))
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int64), logprobs_tensors=lp)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Processors that change the argmax: masks, bias, penalties. Returns a new float32 tensor."""
        logits = logits.to(torch.float32, copy=True)
        logits = apply_allowed_and_bans(logits, md)
        logits = apply_logit_bias(logits, md)
        return apply_penalties(logits, md)

    @staticmethod
    def apply_sampling_warpers(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p (random rows; greedy rows are unaffected by design)."""
        if md.temperature is not None:
            logits = logits.div_(md.temperature.unsqueeze(1))
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        return apply_top_k_top_p(logits, md.top_k, md.max_top_k, md.top_p)

    def processed_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The final logits random rows sample from (softmax gives their distribution); for tests and tools."""
        return self.apply_sampling_warpers(self.apply_logits_processors(logits, md), md)
