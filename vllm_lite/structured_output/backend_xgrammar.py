"""The xgrammar backend (vLLM's default): compiled grammars precompute token masks, so filling is ~microseconds."""

from __future__ import annotations

import json
import re
import warnings
from typing import Any, Optional, Sequence

import torch

from vllm_lite.structured_output.backend_types import (
    GrammarCompileError,
    StructuredOutputBackend,
    StructuredOutputMatcher,
)
from vllm_lite.structured_output.schema_features import xgrammar_unsupported_features
from vllm_lite.structured_output.spec import GrammarSpec, legacy_structural_tag

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message users need.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def compiler_message(exc: BaseException) -> str:
    text = str(exc).strip()
    text = _CPP_PREFIX.sub("", text)
    return text.removeprefix("Check failed: (error.empty()) is false: ").strip() or type(exc).__name__


def unenforced_schema_message(spec: GrammarSpec) -> Optional[str]:
    """Why xgrammar must not take this JSON schema (keywords it would silently not enforce), or None."""
    if spec.kind != "json":
        return None
    features = xgrammar_unsupported_features(json.loads(spec.text))
    if not features:
        return None
    return f"xgrammar does not enforce {', '.join(features)} in JSON schemas"


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: JSON string literals are valid EBNF string literals in xgrammar."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_structural_tag(xgr: Any, compile_fn: Any, text: str) -> Any:
    """xgrammar's structural-tag JSON as is; vLLM's original {"structures", "triggers"} form through tag items."""
    legacy = legacy_structural_tag(text)
    if legacy is None:
        return compile_fn(text)
    structures, triggers = legacy
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]) for s in structures]
    with warnings.catch_warnings():  # the items form is deprecated upstream, still the one vLLM's JSON maps to
        warnings.simplefilter("ignore", DeprecationWarning)
        return compile_fn(items, triggers)


class XgrammarMatcher(StructuredOutputMatcher):
    def __init__(self, matcher: Any) -> None:
        super().__init__()
        self._m = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for t in token_ids:
            if not self._m.accept_token(int(t)):
                return False
            self.num_accepted_tokens += 1
        return True

    def _rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def reset(self) -> None:
        self._m.reset()
        self.num_accepted_tokens = 0


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        # vocab_size is the model's (padded) one: ids past the tokenizer's are always masked.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # We cache compiled grammars ourselves (per spec); xgrammar's own cache would hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.whitespace_pattern is not None:
            raise GrammarCompileError("xgrammar does not support whitespace_pattern")
        unenforced = unenforced_schema_message(spec)
        if unenforced is not None:
            raise GrammarCompileError(unenforced)
        try:
            if spec.kind in ("json", "json_object"):
                return c.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "choice":
                return c.compile_grammar(choice_as_ebnf(json.loads(spec.text)))
            if spec.kind == "grammar":
                return c.compile_grammar(spec.text)
            if spec.kind == "structural_tag":
                return compile_structural_tag(self._xgr, c.compile_structural_tag, spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(compiler_message(e)) from None
        raise GrammarCompileError(f"xgrammar cannot compile a {spec.kind!r} constraint")

    def new_matcher(self, compiled: Any) -> StructuredOutputMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled, max_rollback_tokens=-1))
