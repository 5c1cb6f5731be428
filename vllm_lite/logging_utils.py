"""One logging set-up for every process we start (core, TP ranks, serve, HTTP frontends)."""

from __future__ import annotations

import logging
from typing import Optional, Union

from vllm_lite import envs


def configure_process_logging(tag: str, level: Optional[Union[str, int]] = None) -> None:
    """Log to stderr as `time LEVEL [tag] message`.

    `level` is a name ("DEBUG") or a logging constant; None takes $VLLM_LITE_LOG_LEVEL (default INFO).
    A launcher passes its child's level explicitly rather than through the environment.
    """
    if level is None:
        level = envs.VLLM_LITE_LOG_LEVEL
    if isinstance(level, str):
        level = getattr(logging, level.strip().upper(), logging.INFO)
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [{tag}] %(message)s")
