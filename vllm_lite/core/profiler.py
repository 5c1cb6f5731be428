"""vLLM's torch profiler of the engine core: ``EngineCore.profile(is_start)``, the utility call behind
``LLM.start_profile()`` / ``stop_profile()``, ``AsyncLLM``'s and the server's ``POST /start_profile`` and
``/stop_profile``.

Enabled by ``$VLLM_TORCH_PROFILER_DIR`` in the engine core's process (vLLM's variable). Each start/stop pair
profiles this process's CPU operators, and CUDA kernels and copies where the core runs on CUDA, and writes one
gzipped Chrome trace into that directory on stop: ``engine-core-HOST-pidPID.TIME_NS.pt.trace.json.gz`` (one
name per core process and call, so data-parallel cores and tensor-parallel hosts sharing a directory do not
collide). Open it in Perfetto or chrome://tracing. The trace's top-level ``"vllm_lite_profile"`` says how many
engine steps the window held (the core's step counter at start and stop) and the process that wrote it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Callable, Optional

import torch

from vllm_lite import envs

logger = logging.getLogger("vllm_lite.engine_core")

TRACE_SUFFIX = ".pt.trace.json.gz"
METADATA_KEY = "vllm_lite_profile"


def profiler_dir() -> str:
    """``$VLLM_TORCH_PROFILER_DIR`` (created if missing); ValueError naming the variable when it is unset."""
    path = envs.VLLM_TORCH_PROFILER_DIR
    if not path:
        raise ValueError(
            "Profiling is not enabled: set VLLM_TORCH_PROFILER_DIR to a directory in the environment of the "
            "engine core's process (before it starts) to use start_profile()/stop_profile()."
        )
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    return path


def warm_up(device: torch.device) -> None:
    """With $VLLM_TORCH_PROFILER_DIR set and a CUDA core: start and stop torch.profiler once before the model
    is loaded and its CUDA graphs captured. CUPTI, up before the capture, traces the graphs' kernels one by
    one (as benchmarks/gpu.py's in-process profile does); its slow first start is also out of the windows."""
    if not envs.VLLM_TORCH_PROFILER_DIR or device.type != "cuda" or not torch.cuda.is_available():
        return
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        torch.ones(16, device=device).add_(1).sum().item()
    torch.cuda.synchronize(device)


class EngineCoreProfiler:
    """One torch.profiler.profile at a time, started and stopped between engine steps (the caller drains the
    steps in flight first, so the window holds whole steps)."""

    def __init__(self, device: torch.device, step_counter: Callable[[], int]) -> None:
        self.device = device
        self._step_counter = step_counter
        self._prof: Optional[Any] = None
        self._start_step = 0
        self._start_time_ns = 0
        self._dir = ""
        self.last_trace: Optional[str] = None

    @property
    def running(self) -> bool:
        return self._prof is not None

    def activities(self) -> list[Any]:
        from torch.profiler import ProfilerActivity

        acts = [ProfilerActivity.CPU]
        if self.device.type == "cuda" and torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        return acts

    def profile(self, is_start: bool) -> Optional[str]:
        """vLLM's ``profile(is_start)``: start, or stop and write the trace (its path is returned)."""
        return self.start() if is_start else self.stop()

    def start(self) -> None:
        directory = profiler_dir()  # checked first: an unset variable is the clearer error
        if self._prof is not None:
            raise RuntimeError("The profiler is already running: call stop_profile() before start_profile() again.")
        prof = torch.profiler.profile(activities=self.activities())
        prof.start()
        self._prof = prof
        self._dir = directory
        self._start_step = self._step_counter()
        self._start_time_ns = time.time_ns()
        logger.info("torch profiler started (traces go to %s)", directory)

    def stop(self) -> str:
        prof = self._prof
        if prof is None:
            profiler_dir()  # unset: that is the clearer error
            raise RuntimeError("The profiler is not running: call start_profile() before stop_profile().")
        self._prof = None
        steps = self._step_counter() - self._start_step
        meta = {
            "engine_steps": steps,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": str(self.device),
            "start_time_ns": self._start_time_ns,
            "stop_time_ns": time.time_ns(),
        }
        try:
            prof.add_metadata_json(METADATA_KEY, json.dumps(meta))
        finally:
            prof.stop()
        name = f"engine-core-{_safe(meta['host'])}-pid{meta['pid']}.{time.time_ns()}{TRACE_SUFFIX}"
        path = os.path.join(self._dir, name)
        prof.export_chrome_trace(path)
        self.last_trace = path
        logger.info("torch profiler stopped after %d engine steps; trace written to %s", steps, path)
        return path

    def shutdown(self) -> None:
        """Stop a profile still running, without writing it (the core is going away)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: BLE001 -- shutting down
                logger.debug("stopping the profiler at shutdown failed", exc_info=True)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text) or "host"
