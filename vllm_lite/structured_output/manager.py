"""The engine core's StructuredOutputManager: compile off the step loop, cache, fill the batch's bitmask.

Compilation runs in a small thread pool (xgrammar and llguidance release the GIL while compiling), so a
request waits for its grammar without holding the batch up. Compiled grammars are cached per engine, i.e.
per tokenizer, by (backend, spec); identical specs compiling at once share one compile. The tokenizer and
the backends are built on the first constrained request, so engines that never see one pay nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import numpy as np
import torch

from vllm_lite.config import StructuredOutputsConfig, VllmConfig
from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.structured_output.backend_types import (
    GrammarCompileError,
    StructuredOutputBackend,
    StructuredOutputMatcher,
)
from vllm_lite.structured_output.request import StructuredOutputRequest
from vllm_lite.structured_output.spec import GrammarSpec, spec_from_params

logger = logging.getLogger("vllm_lite.structured_output")

_MAX_CACHED_GRAMMARS = 1024


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token of the logits' width."""
    return (vocab_size + 31) // 32


def load_tokenizer(path: str) -> Any:
    """The checkpoint's Hugging Face tokenizer (local directory), for the backends' token tables."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class _CacheEntry:
    """One spec's compile: the first thread to take `lock` compiles, later ones read the result."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.result: Optional[tuple[StructuredOutputBackend, Any]] = None
        self.error: Optional[str] = None


class StructuredOutputManager:
    def __init__(self, vllm_config: VllmConfig, max_workers: int = 2) -> None:
        self.config: StructuredOutputsConfig = vllm_config.structured_outputs_config
        self.vocab_size = vllm_config.model_config.vocab_size
        self.tokenizer_path = vllm_config.model_config.tokenizer
        self._max_workers = max_workers
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, GrammarSpec], _CacheEntry] = OrderedDict()
        self._ready = threading.Event()  # set whenever a grammar finishes preparing

    # ------------------------------------------------------------------ requests
    def grammar_init(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start preparing a request's grammar in the pool; returns at once."""
        future: Future[StructuredOutputMatcher]
        try:
            spec = spec_from_params(
                params, self.config.disable_any_whitespace, self.config.disable_additional_properties
            )
        except ValueError as e:
            future = Future()
            future.set_exception(GrammarCompileError(str(e)))
            return StructuredOutputRequest(future)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix="vllm_lite-grammar")
        future = self._executor.submit(self._prepare, spec)
        future.add_done_callback(lambda _: self._ready.set())
        return StructuredOutputRequest(future)

    def wait_for_grammar(self, timeout: float) -> None:
        """Block up to `timeout` s until some grammar finishes (for a step loop with nothing else to run)."""
        self._ready.wait(timeout)
        self._ready.clear()

    def fill_bitmask(self, matchers: Sequence[StructuredOutputMatcher]) -> np.ndarray:
        """int32 [len(matchers), words]: row i = what matcher i allows next (each backend fills its rows at once)."""
        bitmask = torch.full((len(matchers), bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        by_kind: dict[type, list[tuple[StructuredOutputMatcher, int]]] = {}
        for row, matcher in enumerate(matchers):
            by_kind.setdefault(type(matcher), []).append((matcher, row))
        for kind, rows in by_kind.items():
            kind.fill_bitmask_batch(rows, bitmask)
        return bitmask.numpy()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ in the pool
    def _prepare(self, spec: GrammarSpec) -> StructuredOutputMatcher:
        """Compiled grammar (cached) -> a fresh matcher. Any failure becomes this request's error."""
        try:
            backend, compiled = self._compiled(spec)
            return backend.new_matcher(compiled)
        except GrammarCompileError:
            raise
        except Exception as e:  # a backend bug or a missing tokenizer: this request fails, the core lives
            logger.exception("structured output setup failed for %s", spec.field)
            raise GrammarCompileError(f"{spec.field}: grammar setup failed: {type(e).__name__}: {e}") from None

    def _compiled(self, spec: GrammarSpec) -> tuple[StructuredOutputBackend, Any]:
        key = (self.config.backend, spec)
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                entry = self._cache[key] = _CacheEntry()
                while len(self._cache) > _MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        with entry.lock:
            if not entry.done:
                try:
                    entry.result = self._compile(spec)
                except GrammarCompileError as e:
                    entry.error = str(e)
                entry.done = True
        if entry.error is not None:
            raise GrammarCompileError(entry.error)
        assert entry.result is not None
        return entry.result

    def _compile(self, spec: GrammarSpec) -> tuple[StructuredOutputBackend, Any]:
        """auto: xgrammar, else guidance (unless disable_fallback); the error names each compiler's message."""
        names = ["xgrammar", "guidance"] if self.config.backend == "auto" else [self.config.backend]
        if self.config.backend == "auto" and self.config.disable_fallback:
            names = ["xgrammar"]
        errors = []
        for name in names:
            backend = self._backend(name)
            try:
                return backend, backend.compile(spec)
            except GrammarCompileError as e:
                errors.append((name, str(e)))
        if len(errors) == 1:
            raise GrammarCompileError(f"invalid {spec.field}: {errors[0][1]}")
        raise GrammarCompileError(f"invalid {spec.field}: " + "; ".join(f"{n}: {m}" for n, m in errors))

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is not None:
                return backend
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.tokenizer_path)
            eos = getattr(self._tokenizer, "eos_token_id", None)
            stop_ids = [eos] if isinstance(eos, int) else []
            if name == "xgrammar":
                from vllm_lite.structured_output.backend_xgrammar import XgrammarBackend

                backend = XgrammarBackend(self._tokenizer, self.vocab_size, stop_ids)
            elif name == "guidance":
                from vllm_lite.structured_output.backend_guidance import GuidanceBackend

                backend = GuidanceBackend(self._tokenizer, self.vocab_size, stop_ids)
            else:
                raise GrammarCompileError(f"unknown structured outputs backend {name!r}")
            self._backends[name] = backend
            return backend
