"""The llguidance backend: computes masks lazily (no per-grammar precompute); takes Lark and GBNF grammars."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import torch

from vllm_lite.structured_output.backend_types import (
    GrammarCompileError,
    StructuredOutputBackend,
    StructuredOutputMatcher,
)
from vllm_lite.structured_output.spec import GrammarSpec, legacy_structural_tag


def _no_additional_properties(schema: Any) -> Any:
    """`additionalProperties: false` on every object schema that does not say (vLLM's option for guidance)."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def guidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text for a spec (not yet checked against a tokenizer)."""
    import llguidance as llg

    if spec.kind in ("json", "json_object"):
        schema = json.loads(spec.text)
        if spec.disable_additional_properties:
            schema = _no_additional_properties(schema)
        defaults: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
        if spec.whitespace_pattern is not None:
            defaults["whitespace_pattern"] = spec.whitespace_pattern
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
    if spec.kind in ("regex", "choice", "grammar"):
        return llg.grammar_from(spec.kind, spec.text)
    if spec.kind == "structural_tag":
        legacy = legacy_structural_tag(spec.text)
        if legacy is not None:
            structures, triggers = legacy
            tags = []
            for s in structures:
                trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
                if trigger is None:
                    raise GrammarCompileError(f"structural_tag: no trigger starts the begin string {s['begin']!r}")
                tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
            return llg.StructTag.to_grammar(tags)
    raise GrammarCompileError(f"the guidance backend does not support {spec.field}")


def check_guidance_grammar(grammar: str, tokenizer: Any) -> None:
    """Raise GrammarCompileError with llguidance's messages if `grammar` is invalid (tokenizer may be None)."""
    import llguidance as llg

    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarCompileError("; ".join(m.strip() for m in messages) or "invalid grammar")


_EXECUTOR: Any = None


def _executor() -> Any:
    """llguidance's own thread pool for batched mask fills, made once per process."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance as llg

        _EXECUTOR = llg.LLExecutor()
    return _EXECUTOR


class GuidanceMatcher(StructuredOutputMatcher):
    def __init__(self, matcher: Any, eos_token_id: Optional[int]) -> None:
        super().__init__()
        self._m = matcher
        self._eos = eos_token_id

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        # try_consume leaves the matcher usable on a refused token (consume_token would put it in error).
        for t in token_ids:
            t = int(t)
            if self._m.try_consume_tokens([t]) != 1:
                # A complete grammar takes EOS through consume_token only.
                if not (t == self._eos and self._m.is_stopped() and self._m.consume_token(t)):
                    return False
            self.num_accepted_tokens += 1
        return True

    def _rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    @classmethod
    def fill_bitmask_batch(cls, rows: Sequence[tuple[StructuredOutputMatcher, int]], bitmask: torch.Tensor) -> None:
        """llguidance computes masks lazily (up to ms per row in a string): rows in parallel, off the GIL."""
        if len(rows) < 2:
            super().fill_bitmask_batch(rows, bitmask)
            return
        import llguidance.torch

        pairs = [(m._m, row) for m, row in rows if isinstance(m, GuidanceMatcher)]
        llguidance.torch.fill_next_token_bitmask_par(_executor(), pairs, bitmask)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def reset(self) -> None:
        self._m.reset()
        self.num_accepted_tokens = 0


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance.hf

        self._eos = stop_token_ids[0] if stop_token_ids else None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self._eos)

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            grammar = guidance_grammar(spec)
        except (ValueError, TypeError) as e:
            raise GrammarCompileError(str(e)) from None
        check_guidance_grammar(grammar, self._tokenizer)
        return grammar

    def new_matcher(self, compiled: Any) -> StructuredOutputMatcher:
        import llguidance as llg

        matcher = llg.LLMatcher(self._tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(matcher.get_error())
        return GuidanceMatcher(matcher, self._eos)
