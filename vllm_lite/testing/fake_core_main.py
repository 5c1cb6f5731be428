"""Entry point of a fake engine-core process (tests): ``python -m vllm_lite.testing.fake_core_main``."""

from __future__ import annotations

import gc

from vllm_lite.core.engine_core_proc import run_engine_core
from vllm_lite.core.messages import EngineCoreArgs
from vllm_lite.launcher_child import ChildChannel, run_child
from vllm_lite.testing.fake_core import FakeEngineCoreProc


def _main(args: EngineCoreArgs, channel: ChildChannel) -> int:
    # The collector as CPython starts it, whatever this interpreter's start-up did (the H100 image's Python came up
    # with objects already frozen), so tests read the core's own gc policy (core/gc_heap.py) and nothing else.
    gc.unfreeze()
    return run_engine_core(args, channel, FakeEngineCoreProc)


if __name__ == "__main__":
    run_child(EngineCoreArgs, _main)
