"""PoolingParams: what a pooling request asks for, with vLLM's field names.

A msgspec Struct (like SamplingParams) so it travels typed inside `EngineCoreRequest`; the
frontend and the core both call `verify` and a bad value is a ValueError naming the field.
`None` fields mean "the model's default" (its pooler config / sentence-transformers files),
filled in by `with_defaults` once the frontend knows the model.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

# vLLM's pooling tasks: one vector per prompt (embed, classify, score) or one per token (encode).
POOLING_TASKS = ("encode", "embed", "classify", "score", "reward", "token_embed", "token_classify")
# The most dimensions a Matryoshka truncation may keep (a sanity cap for untrusted requests).
MAX_DIMENSIONS = 1 << 20
# vLLM's wording for a request of the wrong kind for the model.
GENERATE_ON_POOLING = (
    "generation is only supported for generative models, and this model runs as a pooling model; "
    "try passing `--runner generate` (runner='generate') to use it as a generative model."
)
POOLING_ON_GENERATE = (
    "pooling (encode, embed, classify, score) is only supported for pooling models; "
    "try passing `--runner pooling` (runner='pooling') to use the model as a pooling model."
)


class PoolingParams(msgspec.Struct, omit_defaults=True, array_like=True):
    """API parameters for pooling models (vLLM's `PoolingParams`).

    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: up to max_model_len).
    dimensions: keep the first k dimensions of the embedding (Matryoshka), before normalising.
    normalize: L2-normalise the embedding (None: the model's default).
    activation / softmax / use_activation: apply the classifier's activation to its scores
        (softmax, or sigmoid for one label); `use_activation` is vLLM's newer name for both.
    task: set by `LLM.embed`/`classify`/... (vLLM fills it the same way).
    """

    truncate_prompt_tokens: Optional[int] = None
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    activation: Optional[bool] = None
    softmax: Optional[bool] = None
    use_activation: Optional[bool] = None
    task: Optional[str] = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self, hidden_size: Optional[int] = None) -> None:
        """Raise ValueError naming the first bad field; `hidden_size` bounds `dimensions` when known."""
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}.")
        d = self.dimensions
        if d is not None:
            if not _is_int(d) or d < 1 or d > MAX_DIMENSIONS:
                raise ValueError(f"dimensions must be a positive integer, got {d!r}.")
            if hidden_size is not None and d > hidden_size:
                raise ValueError(f"dimensions must be at most the model's embedding size {hidden_size}, got {d}.")
            if self.task is not None and self.task not in ("embed", "encode", "token_embed", "score"):
                raise ValueError(f"dimensions applies to embeddings only, not to task {self.task!r}.")
        for name in ("normalize", "activation", "softmax", "use_activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool or None, got {v!r}.")

    def clone(self) -> "PoolingParams":
        return msgspec.structs.replace(self)

    @property
    def apply_activation(self) -> Optional[bool]:
        """The classifier activation asked for, whichever of vLLM's three names set it (None: default)."""
        for v in (self.use_activation, self.activation, self.softmax):
            if v is not None:
                return v
        return None

    def with_defaults(self, task: str, normalize: bool, activation: bool) -> "PoolingParams":
        """A copy for the core with every choice made: the task, and normalize/activation from the model."""
        p = self.clone()
        if p.task is None:
            p.task = task
        if p.normalize is None:
            p.normalize = normalize
        if p.apply_activation is None:
            p.use_activation = activation
        p.verify()
        return p

    def __repr__(self) -> str:
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        return "PoolingParams(" + ", ".join(f"{k}={v!r}" for k, v in fields.items() if v is not None) + ")"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
