"""ShutdownState: running -> draining(deadline) -> stopped, as the engine core's busy loop drives it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from vllm_lite.core.shutdown import Phase, ShutdownState


def test_running_until_asked_then_stops_once_nothing_is_left():
    s = ShutdownState(drain_timeout_s=30.0)
    assert s.advance(has_unfinished=False, now=0.0) is Phase.RUNNING and not s.requested
    s.request()
    assert s.requested and s.advance(has_unfinished=True, now=100.0) is Phase.DRAINING
    assert s.deadline == 130.0
    assert s.advance(has_unfinished=True, now=129.9) is Phase.DRAINING
    assert s.advance(has_unfinished=False, now=129.95) is Phase.STOPPED and not s.drain_expired


def test_drain_past_the_deadline_stops_and_says_it_expired():
    s = ShutdownState(drain_timeout_s=5.0)
    s.request()
    s.request()  # idempotent
    s.advance(has_unfinished=True, now=10.0)
    assert s.advance(has_unfinished=True, now=15.0) is Phase.STOPPED and s.drain_expired
    assert s.advance(has_unfinished=False, now=16.0) is Phase.STOPPED  # stays stopped


def test_idle_core_stops_at_once_and_zero_drain_timeout_gives_up_at_once():
    idle = ShutdownState(drain_timeout_s=30.0)
    idle.request()
    assert idle.advance(has_unfinished=False, now=0.0) is Phase.STOPPED and not idle.drain_expired
    busy = ShutdownState(drain_timeout_s=0.0)
    busy.request()
    assert busy.advance(has_unfinished=True, now=0.0) is Phase.STOPPED and busy.drain_expired


def test_sigterm_and_sigint_request_the_stop_in_a_process_of_their_own():
    code = textwrap.dedent(
        """
        import os, signal
        from vllm_lite.core.shutdown import ShutdownState
        term, both = ShutdownState(1.0), ShutdownState(1.0)
        term.install_signal_handlers(handle_sigint=False)
        os.kill(os.getpid(), signal.SIGTERM)
        assert term.requested
        both.install_signal_handlers(handle_sigint=True)
        os.kill(os.getpid(), signal.SIGINT)
        assert both.requested
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
