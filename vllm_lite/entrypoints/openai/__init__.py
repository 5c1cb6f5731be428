"""OpenAI-compatible HTTP server over `AsyncLLM` (FastAPI + uvicorn).

`build_app` and `run_server` live in `api_server`; they are loaded lazily so
`python -m vllm_lite.entrypoints.openai.api_server` does not import the module twice.
"""

from typing import Any

__all__ = ["build_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vllm_lite.entrypoints.openai import api_server

        return getattr(api_server, name)
    raise AttributeError(name)
