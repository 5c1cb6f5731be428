"""One draft length for every request of a verify step (n-gram, under CUDA graphs): shorter drafts are padded.

Why: the runner replays a CUDA graph for a verify step only when every request runs its last token plus the same
number d of drafts (cuda_graphs.py, `uniform_query_len`); drafts of different lengths, or one request with drafts
beside one without, run eager, which on CUDA costs about twice a replay on the bundled model (~30% of the batch-2
verify steps of the random workload did, H200). With n-gram proposals the batch rule (draft_budget.py) and the
lookup itself give each request its own length (0: nothing found, or sat out), so many batch steps were mixed.

The rule, per step whose sampling requests (B >= 2, every running request among them) carry drafts of lengths
d_i, some d_i > 0:

- the common length is L = max d_i, capped so that the scheduler keeps every padded draft whole (it cuts a draft
  at the request's room under max_model_len and max_tokens, at the step's token budget and at
  long_prefill_token_threshold, core/sched/spec_decode.py `drafts_for` and scheduler.py `_num_new_tokens`), and
  lowered to the longest length with a captured verify graph for B requests (the runner's keys: `verify_graph_sizes`);
  a cap below some d_i truncates those drafts (the last few steps of a request near max_tokens, in practice);
- every request's draft is padded to L with fillers: the cyclic continuation of its own draft (filler t repeats
  draft[t mod d_i]: a lookup cut short by the end of the history implies exactly that continuation) or, without a
  draft, its last token repeated; a request whose lookup found a draft that the batch rule set aside (its
  acceptance is low) verifies that draft (up to L) instead of fillers, since its rows run anyway;
- nothing changes when L would be 0 (a request on its last token beside drafted ones: that one step stays mixed,
  an eager verify step, rather than dropping the others' drafts), when some request may not speculate (unmet
  min_tokens, multi-token bad words: the scheduler drops its drafts, so the step is mixed whatever this does), or
  when a request is mid-prompt; requests this step's tokens finish (max_tokens, max_model_len) are left out.

Only n-gram drafts are padded: a draft model's sampled proposals carry q per row (rejection_sample_rows), which a
point-mass filler inside such a row would break, and its proposal passes cost per position.

Exactness: a filler is a draft like any other. N-gram drafts are point-mass proposals q = delta(x), and the
rejection sampler (rejection_sampler.py) verifies them by coupling: greedy rows accept x iff it is the position's
argmax (`greedy_verify_host`), random rows iff it equals the token the target's own race draws at that position
(`_match_sample`), and the first mismatch emits that draw. Emitted tokens are therefore always the target's own
samples, whatever x was: any token is a valid proposal, a filler is kept only when it is the token the target
picks there (then it is a correct token, not a guess), and seeded rows still draw once per emitted token. Greedy
outputs, logprobs and the sampled distribution are those of plain decoding (tests/test_spec_decode_uniform.py).

Cost: every filler is a verified row. Under a graph the step costs what its key costs, so fillers are free; on the
CPU (no graphs) each is compute, so the rule is on only where the runner captures verify graphs
(`SpecDecodeStep.uniform_drafts`: None = that, derived from the config as the runner derives its graph keys, and
narrowed to what it captured through `SpecDecodeStep.set_verify_graphs`; True forces it, for tests; False turns
it off). The batch rule and
the acceptance averages see only the real drafts (`SpecDecodeStep.observe`); the scheduler's draft counters
(/metrics, SpecDecodingStats) count fillers as drafts.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from vllm_lite.config import VllmConfig
from vllm_lite.worker.cuda_graphs import (
    choose_bucket,
    graphs_blocked_reason,
    lora_kernels_available,
    resolve_capture_sizes,
    resolve_graph_keys,
    sizes_by_query_len,
)


def verify_graph_sizes(
    vllm_config: VllmConfig, device: torch.device, backend_name: str, tp_size: int = 1
) -> Optional[dict[int, list[int]]]:
    """{q: ascending batch sizes} of the verify graphs (q >= 2) the model runner captures for this config, as its
    `_cudagraph_sizes` / `_cudagraph_keys` derive them (the same cuda_graphs.py functions); None where it runs
    every step eager (CPU, enforce_eager, tensor parallelism, ...) or captures no verify graph."""
    mc, sched = vllm_config.model_config, vllm_config.scheduler_config
    sc, cc = vllm_config.speculative_config, vllm_config.compilation_config
    if sc is None or not sc.num_speculative_tokens:
        return None
    lora = vllm_config.lora_config is not None
    reason = graphs_blocked_reason(
        device=device,
        enforce_eager=mc.enforce_eager,
        backend_name=backend_name,
        tp_size=tp_size,
        lora=lora,
        lora_kernels=lora and device.type == "cuda" and lora_kernels_available(),
    )
    if reason is not None:
        return None
    sizes = resolve_capture_sizes(sched.max_num_seqs, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size)
    keys = resolve_graph_keys(sizes, sc.num_speculative_tokens, sched.max_num_batched_tokens, sc.disable_by_batch_size)
    verify = {q: bs for q, bs in sizes_by_query_len(keys).items() if q > 1}
    return verify or None


class UniformDrafts:
    """Pads a step's drafts to one common length (module docstring); holds no per-request state."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
        graph_sizes: Optional[dict[int, Sequence[int]]] = None,
    ) -> None:
        """graph_sizes: {q: batch sizes} of the captured verify graphs (`verify_graph_sizes`); None: no cap by
        graphs (padding forced without them: tests)."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens!r}.")
        self.k = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.graph_sizes = None if graph_sizes is None else {q: sorted(bs) for q, bs in graph_sizes.items()}
        self.num_padded_steps = 0  # steps whose drafts this padded (counters for benchmarks)
        self.num_filler_tokens = 0

    @property
    def max_batch(self) -> Optional[int]:
        """The most requests a padded step can have (the largest captured verify batch size); None: no limit."""
        if self.graph_sizes is None:
            return None
        return max((max(bs) for bs in self.graph_sizes.values() if bs), default=0)

    def common_length(self, lengths: Sequence[int], room: Sequence[int]) -> int:
        """The step's draft length L for drafts of `lengths` (ints, one per request) and each request's `room` (the
        most drafts the scheduler keeps for it: max_model_len and max_tokens); 0: leave the drafts as they are."""
        b = len(lengths)
        longest = int(max(lengths, default=0))
        if b < 2 or longest == 0:
            return 0
        cap = min(longest, int(min(room)), self.k, self.max_num_batched_tokens // b - 1)
        if self.long_prefill_token_threshold > 0:
            cap = min(cap, self.long_prefill_token_threshold - 1)
        if self.graph_sizes is None:
            return max(cap, 0)
        for length in range(cap, 0, -1):  # the longest that has a graph for b requests
            sizes = self.graph_sizes.get(1 + length)
            if sizes and choose_bucket(sizes, b) is not None:
                return length
        return 0

    def pad(
        self,
        drafts: list[list[int]],
        last_tokens: Sequence[int],
        room: Sequence[int],
        spare: Optional[Sequence[Sequence[int]]] = None,
    ) -> Optional[tuple[list[list[int]], list[int]]]:
        """(every request's draft at the common length, how many of its tokens are the lookup's own), or None to
        leave the drafts as they are. The length comes from `drafts` (what the batch rule kept); a request without
        a draft takes its `spare` (what the lookup found and the rule set aside: its rows are verified anyway, and
        a real proposal beats a filler), else fillers only. `last_tokens`: each request's latest token (the filler
        of an empty draft)."""
        length = self.common_length([len(d) for d in drafts], room)
        if length == 0:
            return None
        out, own = [], []
        for i, (d, last) in enumerate(zip(drafts, last_tokens)):
            if not d and spare is not None:
                d = list(spare[i][:length])
            n = min(len(d), length)
            own.append(n)
            if n == length:
                out.append(d[:length])
            else:  # cyclic: a lookup cut short by the history's end continues that way; none: the last token
                out.append(d + [d[t % n] for t in range(n, length)] if n else [last] * length)
        self.num_padded_steps += 1
        self.num_filler_tokens += length * len(drafts) - sum(own)
        return out, own
