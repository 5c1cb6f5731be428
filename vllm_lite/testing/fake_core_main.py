"""Entry point of a fake engine-core process (tests): ``python -m vllm_lite.testing.fake_core_main``."""

from __future__ import annotations

from vllm_lite.core.engine_core_proc import run_engine_core
from vllm_lite.core.messages import EngineCoreArgs
from vllm_lite.launcher_child import ChildChannel, run_child
from vllm_lite.testing.fake_core import FakeEngineCoreProc


def _main(args: EngineCoreArgs, channel: ChildChannel) -> int:
    return run_engine_core(args, channel, FakeEngineCoreProc)


if __name__ == "__main__":
    run_child(EngineCoreArgs, _main)
