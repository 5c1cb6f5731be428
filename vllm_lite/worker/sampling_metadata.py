"""Everything the sampler needs for one step, already gathered into batch order.

`SamplingState.make_metadata` builds this from its per-row state; the sampler
only reads it. Every optional tensor is None when no row in the batch uses the
feature, so the sampler can skip that work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


@dataclass
class SamplingMetadata:
    """Batched sampling inputs; row i describes logits row i."""

    num_rows: int
    # Rows sampled by argmax (temperature 0): never random.
    all_greedy: bool
    all_random: bool
    greedy_mask: Optional[torch.Tensor]  # bool [N]; None when all_greedy or all_random
    # Temperature per row (1.0 for greedy rows so the division is harmless); None when all greedy.
    temperature: Optional[torch.Tensor]  # float32 [N]
    top_k: Optional[torch.Tensor]  # int64 [N], vocab_size where disabled; None if no row uses top-k
    max_top_k: int  # host-side max of top_k (no device sync needed), 0 when top_k is None
    top_p: Optional[torch.Tensor]  # float32 [N], 1.0 where disabled; None if no row uses top-p
    min_p: Optional[torch.Tensor]  # float32 [N], 0.0 where disabled; None if no row uses min-p
    # Batch indices of the random rows when the batch mixes greedy and random rows (else None), on the device and
    # on the host: the sampler takes them from here instead of reading greedy_mask back (no host sync).
    random_rows: Optional[torch.Tensor] = None  # int64 [R]
    random_rows_host: Optional[np.ndarray] = None  # int64 [R]
    # batch index -> that request's own generator (seeded rows only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Largest number of top logprobs any row asked for; None when no row wants logprobs.
    max_num_logprobs: Optional[int] = None

    # Penalties: all None when every row has neutral penalties.
    presence_penalties: Optional[torch.Tensor] = None  # float32 [N]
    frequency_penalties: Optional[torch.Tensor] = None  # float32 [N]
    repetition_penalties: Optional[torch.Tensor] = None  # float32 [N]
    # Each row's distinct prompt+output tokens (padded by repeating entry 0) and how often each was generated.
    penalty_token_ids: Optional[torch.Tensor] = None  # int64 [N, L]
    penalty_output_counts: Optional[torch.Tensor] = None  # float32 [N, L]

    # Allowed-token confinement: rows with a list, and the (batch index, token) pairs allowed.
    allowed_rows: Optional[torch.Tensor] = None  # bool [N]
    allowed_index: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (int64 [E], int64 [E])
    # Tokens forced to -inf this step: bad words (single, or multi-token whose prefix matched)
    # and stop tokens held back by min_tokens.
    banned_index: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (int64 [E], int64 [E])
    # Additive logit bias entries.
    logit_bias_index: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (int64 [E], int64 [E])
    logit_bias_values: Optional[torch.Tensor] = None  # float32 [E]

    @property
    def no_penalties(self) -> bool:
        return self.penalty_token_ids is None
