"""Structured outputs (vLLM V1's design): constraints compiled into grammars, applied as a token bitmask.

- `backend_types`: the backend and per-request matcher interface; `backend_xgrammar` and `backend_guidance`
  implement it (`auto` = xgrammar, falling back to guidance for what xgrammar cannot take).
- `spec`: a request's `StructuredOutputsParams` (+ the engine's config) as a hashable `GrammarSpec`, the cache key.
- `manager`: the engine core's `StructuredOutputManager`: compiles off the step loop, caches, fills the bitmask.
- `validation`: a cheap frontend check, so a bad constraint is a `ValueError` before it reaches the core.

This package imports no layer (client/core/worker/entrypoints): every layer may use it.
"""
