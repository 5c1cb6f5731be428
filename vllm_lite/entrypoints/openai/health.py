"""Is the engine alive and making progress? (/health, and the exit-on-death watchdog)

Alive: the client has not marked the engine dead, and the core answers a
stats call in time. Making progress: when requests are pending, the core's
step counter keeps moving; pending requests with no finished step for
`stuck_timeout_s` mean the core is stuck (e.g. a hung kernel) and /health
says 503 so a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from vllm_lite.client.exceptions import EngineDeadError
from vllm_lite.entrypoints.openai.utils import cancel_and_wait

logger = logging.getLogger(__name__)


@dataclass
class HealthStatus:
    healthy: bool
    dead: bool = False
    reason: str = ""
    stats: Optional[dict[str, Any]] = None


def engine_is_dead(engine: Any) -> bool:
    """The engine client's own verdict (AsyncLLM.errored / is_running)."""
    if bool(getattr(engine, "errored", False)):
        return True
    running = getattr(engine, "is_running", True)
    return running is False


class HealthMonitor:
    """Polls the core's scheduler stats; remembers when the step counter last moved."""

    def __init__(
        self,
        engine: Any,
        stuck_timeout_s: float = 60.0,
        probe_timeout_s: float = 10.0,
        poll_interval_s: float = 1.0,
        on_dead: Optional[Callable[[str], Awaitable[None] | None]] = None,
    ) -> None:
        if stuck_timeout_s <= 0 or probe_timeout_s <= 0 or poll_interval_s <= 0:
            raise ValueError(
                f"health timeouts must be positive, got stuck_timeout_s={stuck_timeout_s!r}, "
                f"probe_timeout_s={probe_timeout_s!r}, poll_interval_s={poll_interval_s!r}."
            )
        self.engine = engine
        self.stuck_timeout_s = stuck_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.poll_interval_s = poll_interval_s
        self.on_dead = on_dead
        self.dead_reason: Optional[str] = None
        self._last_step: Optional[int] = None
        self._last_progress = time.monotonic()
        self._task: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ checks
    async def check(self) -> HealthStatus:
        """One probe: dead, stuck, or healthy (with the stats it saw)."""
        if self.dead_reason is not None:
            return HealthStatus(False, dead=True, reason=self.dead_reason)
        if engine_is_dead(self.engine):
            return await self._mark_dead("the engine core is dead")
        async with self._lock:  # concurrent /health calls share the probe's bookkeeping
            try:
                stats = await asyncio.wait_for(
                    self.engine.call_utility_async("get_stats"), timeout=self.probe_timeout_s
                )
            except EngineDeadError as e:
                return await self._mark_dead(str(e))
            except asyncio.TimeoutError:
                if engine_is_dead(self.engine):
                    return await self._mark_dead("the engine core is dead")
                return HealthStatus(False, reason=f"the engine core did not answer within {self.probe_timeout_s} s")
            return self._judge_progress(stats if isinstance(stats, dict) else {})

    def _judge_progress(self, stats: dict[str, Any]) -> HealthStatus:
        now = time.monotonic()
        pending = int(stats.get("num_running_reqs", 0)) + int(stats.get("num_waiting_reqs", 0))
        step = stats.get("step_counter")
        if step != self._last_step or pending == 0:
            self._last_step = step
            self._last_progress = now
        stalled = now - self._last_progress
        if pending and stalled > self.stuck_timeout_s:
            return HealthStatus(
                False,
                reason=f"the engine core is stuck: {pending} requests pending and no step finished "
                f"for {stalled:.1f} s (limit {self.stuck_timeout_s} s)",
                stats=stats,
            )
        return HealthStatus(True, stats=stats)

    async def _mark_dead(self, reason: str) -> HealthStatus:
        first = self.dead_reason is None
        self.dead_reason = reason
        if first:
            logger.error("engine is dead: %s", reason)
            if self.on_dead is not None:
                result = self.on_dead(reason)
                if asyncio.iscoroutine(result):
                    await result
        return HealthStatus(False, dead=True, reason=reason)

    async def notify_dead(self, reason: str) -> None:
        """A request handler saw EngineDeadError: record it (and fire on_dead once)."""
        await self._mark_dead(reason)

    def revive(self) -> None:
        """The frontend re-attached to a core (the engine behind it is a new one): healthy again
        until a probe says otherwise, and a later death fires on_dead again."""
        if self.dead_reason is None:
            return
        logger.info("engine is back (was: %s)", self.dead_reason)
        self.dead_reason = None
        self._last_step = None
        self._last_progress = time.monotonic()
        if self._task is not None and self._task.done():
            self._task = None
            self.start()

    # ------------------------------------------------------------------ background polling
    def start(self) -> None:
        """Poll in the background so progress is tracked (and death noticed) even when nobody calls /health."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-health-monitor")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while self.dead_reason is None:
            try:
                status = await self.check()
                if not status.healthy and not status.dead:
                    logger.warning("engine unhealthy: %s", status.reason)
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed probe must not kill the monitor
                logger.exception("health probe failed")
            await asyncio.sleep(self.poll_interval_s)
