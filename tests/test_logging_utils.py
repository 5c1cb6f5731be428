"""Process logging honours $VLLM_LITE_LOG_LEVEL (the CLI quiets its engine core with it)."""

from __future__ import annotations

import logging

import pytest

from vllm_lite.logging_utils import configure_process_logging


@pytest.mark.parametrize("env, level", [("WARNING", logging.WARNING), ("debug", logging.DEBUG), (None, logging.INFO)])
def test_level_comes_from_the_environment(monkeypatch, env, level) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = []
    if env is None:
        monkeypatch.delenv("VLLM_LITE_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LITE_LOG_LEVEL", env)
    try:
        configure_process_logging("core")
        assert root.level == level
        assert "[core]" in root.handlers[0].formatter._fmt
    finally:
        root.handlers, _ = saved
        root.setLevel(saved[1])
