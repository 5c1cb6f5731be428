"""OpenAI-compatible HTTP server over `AsyncLLM` (FastAPI + uvicorn)."""

from vllm_lite.entrypoints.openai.api_server import build_app, run_server

__all__ = ["build_app", "run_server"]
