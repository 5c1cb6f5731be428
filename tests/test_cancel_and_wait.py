"""Stopping a background task of the HTTP layer (entrypoints/openai/utils.py's cancel_and_wait), as the health
monitor and the frontend's re-attacher do on shutdown: the task is cancelled and waited out, and neither its
cancellation nor an error it ended with reaches the caller."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from vllm_lite.entrypoints.openai.health import HealthMonitor
from vllm_lite.entrypoints.openai.utils import cancel_and_wait
from vllm_lite.entrypoints.reattach import Reattacher


def test_a_running_task_is_cancelled_and_finished_on_return() -> None:
    async def main() -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        await asyncio.sleep(0)  # let it start
        await cancel_and_wait(task)
        assert task.done()
        return task

    assert asyncio.run(main()).cancelled()


def test_an_error_the_task_ended_with_is_not_raised_and_none_is_nothing_to_stop() -> None:
    async def failing() -> None:
        raise RuntimeError("boom")

    async def main() -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(failing())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        await cancel_and_wait(None)
        return task

    task = asyncio.run(main())
    assert isinstance(task.exception(), RuntimeError)


def test_a_task_that_will_not_stop_at_once_is_waited_for() -> None:
    seen: list[str] = []

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # cleanup that takes a turn of the loop
            seen.append("cleaned up")
            raise

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(slow_to_stop())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        assert seen == ["cleaned up"]

    asyncio.run(main())


def test_the_health_monitor_and_the_reattacher_stop_their_tasks() -> None:
    async def main() -> None:
        monitor = HealthMonitor(engine=None)
        monitor._task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        polling = monitor._task
        await asyncio.sleep(0)
        await monitor.stop()
        assert polling.cancelled() and monitor._task is None
        handle = SimpleNamespace(model_config=SimpleNamespace(model="m"))  # all its first hour of waiting reads
        reattacher = Reattacher(args=None, handle=handle, app=None, interval_s=3600.0)  # type: ignore[arg-type]
        reattacher.start()
        waiting = reattacher._task
        assert waiting is not None
        await asyncio.sleep(0)
        await reattacher.stop()
        assert waiting.cancelled()

    asyncio.run(main())
