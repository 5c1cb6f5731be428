"""One logging set-up for every process we start (core, TP ranks, serve, HTTP frontends)."""

from __future__ import annotations

import logging
import os


def configure_process_logging(tag: str) -> None:
    """Log to stderr as `time LEVEL [tag] message`; level from $VLLM_LITE_LOG_LEVEL (default INFO)."""
    level = os.environ.get("VLLM_LITE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format=f"%(asctime)s %(levelname)s [{tag}] %(message)s")
