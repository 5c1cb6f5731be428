"""Entry point of an engine-core process: ``python -m vllm_lite.core.engine_core_main`` (started by the launcher)."""

from __future__ import annotations

from vllm_lite.core.engine_core_proc import run_engine_core
from vllm_lite.core.messages import EngineCoreArgs
from vllm_lite.launcher_child import run_child


def main() -> None:
    run_child(EngineCoreArgs, run_engine_core)


if __name__ == "__main__":
    main()
