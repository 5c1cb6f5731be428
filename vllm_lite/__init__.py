"""vllm-lite: a small LLM inference engine in the shape of vLLM V1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Heavy modules load on first use, so `import vllm_lite` stays cheap.
_LAZY = {
    "LLM": "vllm_lite.entrypoints.llm",
    "LLMEngine": "vllm_lite.client.llm_engine",
    "AsyncLLM": "vllm_lite.client.async_llm",
    "EngineArgs": "vllm_lite.engine_args",
    "SamplingParams": "vllm_lite.sampling_params",
    "BeamSearchParams": "vllm_lite.sampling_params",
    "RequestOutputKind": "vllm_lite.sampling_params",
    "RequestOutput": "vllm_lite.outputs",
    "CompletionOutput": "vllm_lite.outputs",
    "Logprob": "vllm_lite.outputs",
    "EngineDeadError": "vllm_lite.client.exceptions",
    "PoolingParams": "vllm_lite.pooling_params",
    "PoolingOutput": "vllm_lite.outputs",
    "PoolingRequestOutput": "vllm_lite.outputs",
    "EmbeddingOutput": "vllm_lite.outputs",
    "EmbeddingRequestOutput": "vllm_lite.outputs",
    "ClassificationOutput": "vllm_lite.outputs",
    "ClassificationRequestOutput": "vllm_lite.outputs",
    "ScoringOutput": "vllm_lite.outputs",
    "ScoringRequestOutput": "vllm_lite.outputs",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from vllm_lite.client.llm_engine import LLMEngine
    from vllm_lite.engine_args import EngineArgs
    from vllm_lite.entrypoints.llm import LLM
    from vllm_lite.outputs import CompletionOutput, Logprob, RequestOutput
    from vllm_lite.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vllm_lite' has no attribute {name!r}")
