"""Sampling parameters with vLLM's names and meanings.

`SamplingParams` is a msgspec struct so that it travels to the engine core
unchanged (no pickle) and validates itself on construction and on decode.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Optional, Union

import msgspec

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """How a streaming caller wants outputs: whole text so far, only the new piece, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One output constraint, as vLLM's `StructuredOutputsParams`: exactly one of the constraint fields is set.

    It travels inside `SamplingParams` over the ZMQ protocol; the core's grammar backend compiles it.
    """

    json: Optional[Union[str, dict[str, Any]]] = None  # a JSON schema (object or its JSON text)
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None  # EBNF/GBNF or Lark, as the backend takes it
    json_object: Optional[bool] = None  # any JSON object
    structural_tag: Optional[str] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) > 1:
            raise ValueError(f"structured_outputs: only one kind of constraint may be set, got {', '.join(kinds)}.")
        if not kinds:
            raise ValueError(
                "structured_outputs: one constraint must be set (json, regex, choice, grammar, json_object or "
                "structural_tag)."
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"structured_outputs.json must be a JSON schema object or string, got {self.json!r}.")
        for field in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{field} must be a string, got {value!r}.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or any(not isinstance(c, str) for c in self.choice):
                raise TypeError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}.")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty.")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class SamplingParams(
    msgspec.Struct,
    omit_defaults=True,
    kw_only=True,
    dict=True,  # lets the frontend cache derived data (e.g. tokenized bad words)
):
    """Parameters for one request's sampling, as in vLLM."""

    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Filled in by the frontend: token-id sequences for bad_words, and EOS ids
    # from generation_config that count as stop tokens.
    _bad_words_token_ids: Optional[list[list[int]]] = None
    _all_stop_token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is True:
                setattr(self, field, 1)
            elif value is False:
                setattr(self, field, None)
        if isinstance(self.logit_bias, dict):
            # OpenAI's JSON sends token ids as string keys ("50256": -100).
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self._verify_types()
        if 0 < self.temperature < _SAMPLING_EPS:
            # Tiny temperatures blow up the division; treat as greedy-ish but stay random.
            self.temperature = max(self.temperature, _SAMPLING_EPS)
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: other truncations are meaningless.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        if self._all_stop_token_ids is None:
            self._all_stop_token_ids = list(self.stop_token_ids)

    # ------------------------------------------------------------------ validation
    def _verify_types(self) -> None:
        """Wrong types fail here with the field's name, before any comparison can raise an obscure error."""
        for field in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{field} must be a number, got {value!r}.")
            if not math.isfinite(value):
                raise ValueError(f"{field} must be finite, got {value!r}.")
        for field in ("n", "top_k", "min_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{field} must be an integer, got {value!r}.")
        for field in ("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{field} must be an integer or None, got {value!r}.")
        for field in ("stop_token_ids", "allowed_token_ids", "bad_words", "stop"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, list):
                raise TypeError(f"{field} must be a list, got {value!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}."
            )
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}.")

    def _verify_args(self) -> None:
        def bad(field: str, value: Any, why: str) -> ValueError:
            return ValueError(f"{field} {why}, got {value!r}.")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if self.best_of is not None and self.best_of < self.n:
            raise bad("best_of", self.best_of, f"must be >= n ({self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be -1 or 0 (disable), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "must be non-negative")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", self.prompt_logprobs, "must be non-negative")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise bad("seed", self.seed, "must be in [-2**63, 2**64)")
        assert isinstance(self.stop, list)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "must contain only non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", self.stop_token_ids, "must contain only non-negative integers")
        if self.stop and not self.detokenize:
            raise bad("stop", self.stop, "requires detokenize=True (stop strings are matched on text)")
        if self.logit_bias is not None:
            for tok, b in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise bad("logit_bias", self.logit_bias, "keys must be non-negative token ids")
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= float(b) <= 100.0:
                    raise bad("logit_bias", self.logit_bias, "values must be numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise bad("allowed_token_ids", self.allowed_token_ids, "must not be empty")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", self.allowed_token_ids, "must contain non-negative token ids")
        if any(not isinstance(w, str) or w == "" for w in self.bad_words or []):
            raise bad("bad_words", self.bad_words, "must contain only non-empty strings")
        if self._bad_words_token_ids is not None:
            for w in self._bad_words_token_ids:
                if (
                    not isinstance(w, list)
                    or not w
                    or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in w)
                ):
                    raise bad(
                        "bad_words_token_ids",
                        self._bad_words_token_ids,
                        "must be non-empty lists of non-negative token ids",
                    )
        if self._all_stop_token_ids is not None and any(
            not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self._all_stop_token_ids
        ):
            raise bad("all_stop_token_ids", self._all_stop_token_ids, "must contain only non-negative integers")
        if self.best_of is not None and self.best_of > 1 and self.temperature < _SAMPLING_EPS:
            # As vLLM: greedy samples are all the same sequence, so there is nothing to pick the best of.
            raise bad("best_of", self.best_of, "must be 1 when using greedy sampling (temperature 0)")

    def verify_vocab(self, vocab_size: int) -> None:
        """Token-id fields must name real tokens; called by the frontend once the model is known."""
        for field in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, field) or []
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"{field} contains a token id out of vocabulary (size {vocab_size}), got {ids!r}.")
        if self.logit_bias and any(t >= vocab_size for t in self.logit_bias):
            raise ValueError(
                f"logit_bias contains a token id out of vocabulary (size {vocab_size}), got {self.logit_bias!r}."
            )

    # ------------------------------------------------------------------ derived
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def num_samples(self) -> int:
        """Sequences the engine generates: best_of when set (the top n are returned), else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def all_stop_token_ids(self) -> list[int]:
        return list(self._all_stop_token_ids or [])

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return list(self._bad_words_token_ids or [])

    def clone(self) -> "SamplingParams":
        return msgspec.structs.replace(self)

    def __repr__(self) -> str:
        fields = {f: getattr(self, f) for f in self.__struct_fields__ if not f.startswith("_")}
        return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def _token_key(key: Any) -> Any:
    """Accept decimal-string token ids (JSON object keys); anything else is left for validation to reject."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """Parameters for `LLM.beam_search`, as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width!r}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
