"""Turn the core's logprob tensors into vLLM's per-position `{token_id: Logprob}` dicts.

The core ships top-k logprobs as tensors (column 0 = the sampled or prompt
token). Users want Python dicts with decoded token text, trimmed to the number
of candidates *they* asked for (a batch may carry more columns than one request
needs, because the sampler computes the batch maximum).
"""

from __future__ import annotations

from typing import Any, Optional

from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest, LogprobsTensors
from vllm_lite.outputs import Logprob, PromptLogprobs, SampleLogprobs


class TokenTextCache:
    """Decodes single token ids, remembering results (a token's lone text never changes).

    Shared by all requests of one `OutputProcessor`, so hot tokens decode once.
    """

    def __init__(self, tokenizer: Any, max_entries: int = 1 << 16) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._cache: dict[int, str] = {}

    def decode(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode_uncached(token_id)
        return text

    def _decode_uncached(self, token_id: int) -> str:
        try:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) or ""
        except Exception:  # an id the tokenizer does not know (padded model vocab)
            text = ""
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[token_id] = text
        return text

    def decode_many(self, token_ids: list[int]) -> list[str]:
        return [self.decode(t) for t in token_ids]


def _to_lists(tensors: LogprobsTensors, num_columns: int) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """One host copy per field (tolist), then trim rows to the columns this request wants.

    Trimming the Python lists is cheaper than slicing tensors first (each torch op costs µs).
    """

    def as_list(x: Any) -> list:
        return x.tolist() if hasattr(x, "tolist") else list(x)

    id_rows = as_list(tensors.logprob_token_ids)
    lp_rows = as_list(tensors.logprobs)
    if id_rows and len(id_rows[0]) > num_columns:
        id_rows = [row[:num_columns] for row in id_rows]
        lp_rows = [row[:num_columns] for row in lp_rows]
    return id_rows, lp_rows, as_list(tensors.selected_token_ranks)


def make_position_dicts(
    tensors: LogprobsTensors, num_logprobs: int, text_cache: Optional[TokenTextCache]
) -> tuple[list[dict[int, Logprob]], list[float]]:
    """Per row: the chosen token first (with its true rank), then the top `num_logprobs` by rank.

    Returns the dicts and the chosen tokens' logprobs (for cumulative sums).
    """
    id_rows, lp_rows, ranks = _to_lists(tensors, num_logprobs + 1)
    decode = text_cache.decode if text_cache is not None else (lambda _tid: None)
    dicts: list[dict[int, Logprob]] = []
    chosen: list[float] = []
    for row_ids, row_lps, chosen_rank in zip(id_rows, lp_rows, ranks):
        tid0 = int(row_ids[0])
        d: dict[int, Logprob] = {tid0: Logprob(float(row_lps[0]), int(chosen_rank), decode(tid0))}
        for j in range(1, len(row_ids)):
            tid = int(row_ids[j])
            if tid not in d:  # the chosen token may also be in the top-k: keep one entry
                d[tid] = Logprob(float(row_lps[j]), j, decode(tid))
        dicts.append(d)
        chosen.append(float(row_lps[0]))
    return dicts, chosen


class LogprobsProcessor:
    """Accumulates one request's sample and prompt logprobs as they stream in."""

    def __init__(
        self,
        num_logprobs: Optional[int],
        num_prompt_logprobs: Optional[int],
        text_cache: Optional[TokenTextCache],
    ) -> None:
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.text_cache = text_cache
        self.logprobs: Optional[SampleLogprobs] = [] if num_logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if num_logprobs is not None else None
        # Position 0 of a prompt has no logprob (nothing precedes it).
        self.prompt_logprobs: Optional[PromptLogprobs] = [None] if num_prompt_logprobs is not None else None
        # Index into self.logprobs / prompt_logprobs of the first entry not yet returned as a delta.
        self._sample_delta_start = 0
        self._prompt_delta_start = 0

    @classmethod
    def from_new_request(cls, request: EngineCoreRequest, text_cache: Optional[TokenTextCache]) -> "LogprobsProcessor":
        params = request.sampling_params
        return cls(params.logprobs, params.prompt_logprobs, text_cache if params.detokenize else None)

    def update_from_output(self, output: EngineCoreOutput) -> None:
        if output.new_logprobs is not None and self.logprobs is not None:
            dicts, chosen = make_position_dicts(output.new_logprobs, self.num_logprobs or 0, self.text_cache)
            self.logprobs.extend(dicts)
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += sum(chosen)
        if output.new_prompt_logprobs_tensors is not None and self.prompt_logprobs is not None:
            dicts, _ = make_position_dicts(
                output.new_prompt_logprobs_tensors, self.num_prompt_logprobs or 0, self.text_cache
            )
            self.prompt_logprobs.extend(dicts)

    def pop_sample_delta(self) -> Optional[SampleLogprobs]:
        """Logprobs added since the last pop (for DELTA outputs)."""
        if self.logprobs is None:
            return None
        delta = self.logprobs[self._sample_delta_start :]
        self._sample_delta_start = len(self.logprobs)
        return delta

    def pop_prompt_delta(self) -> Optional[PromptLogprobs]:
        """Prompt logprobs added since the last pop; None once all were returned (as vLLM's DELTA)."""
        if self.prompt_logprobs is None:
            return None
        delta = self.prompt_logprobs[self._prompt_delta_start :]
        self._prompt_delta_start = len(self.prompt_logprobs)
        return delta or None
