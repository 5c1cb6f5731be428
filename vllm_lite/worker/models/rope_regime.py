"""Where a model's rotary embedding switches regime with the request's length (Phi-3 LongRoPE), as transformers does.

Pure Python over a config object or its config.json dict, so the scheduler (core) and the model code
(worker) read the same threshold without importing torch or transformers.

transformers' Phi-3 rotates with the short factors while a sequence has at most
original_max_position_embeddings tokens and with the long factors past it, and its generate() drops the KV
cache and recomputes the whole sequence at the step the sequence first grows past it
(Phi3ForCausalLM.prepare_inputs_for_generation). Other models never switch: the answer is None.

Which generate() we follow: the one that recomputes (transformers 5.24), whatever transformers is installed.
transformers 5.17's generate() drops the cache at the switch too, but then feeds only the newest token (its
next_sequence_length stays 1), at position 0 with nothing before it, and drops the one-token cache again every
later step, so from the switch on each token is predicted from the previous token alone. That is a bug, not a
regime: following it would make the engine forget the request. So the engine always recomputes the whole
sequence, and the test oracle (vllm_lite/testing/hf_oracle.py) checks the installed generate() by a feature test
(generate_recomputes_at_rope_switch) and, where it does not recompute, steps the model itself with the same
recompute (hf_greedy) instead of calling it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

LONGROPE_TYPES = ("longrope", "su")
_RECOMPUTING_MODEL_TYPES = ("phi3",)  # the architectures whose HF generate() recomputes at the switch


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def longrope_original_max_position(config: Any) -> Optional[int]:
    """original_max_position_embeddings of a LongRoPE config (rope parameters first, then top level); else None."""
    rope = _get(config, "rope_parameters")
    if not isinstance(rope, Mapping) or not (rope.get("rope_type") or rope.get("type")):
        rope = _get(config, "rope_scaling")
    if not isinstance(rope, Mapping) or (rope.get("rope_type") or rope.get("type")) not in LONGROPE_TYPES:
        return None
    original = rope.get("original_max_position_embeddings") or _get(config, "original_max_position_embeddings")
    return int(original) if original else None


def rope_recompute_at(config: Any) -> Optional[int]:
    """The length past which a request's tokens use the long set and its earlier KV must be recomputed.

    None for every model whose rotation does not depend on the request's length, so nothing changes for them.
    """
    if _get(config, "model_type") not in _RECOMPUTING_MODEL_TYPES:
        return None
    return longrope_original_max_position(config)
