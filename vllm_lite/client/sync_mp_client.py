"""The blocking process client: a background thread receives outputs into a queue and watches the core."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import zmq

from vllm_lite.client.client_base import OutputItem, shut_down_error, take_output
from vllm_lite.client.mp_client import MPClientBase
from vllm_lite.config import VllmConfig
from vllm_lite.core.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType


class SyncMPClient(MPClientBase):
    """Blocking client; ``get_output()`` blocks on the queue the receive thread fills."""

    # LLMEngine may flag requests await_stop_verdict and answer outputs that ask with send_stop_verdict.
    supports_stop_verdicts = True

    def __init__(self, vllm_config: Optional[VllmConfig] = None, **kwargs: Any) -> None:
        super().__init__(vllm_config, **kwargs)
        self._send_lock = threading.Lock()
        self._outputs: queue.Queue[OutputItem] = queue.Queue()
        self._thread = threading.Thread(target=self._receive_loop, name="core-client-output", daemon=True)
        self._threads.append(self._thread)
        self._thread.start()

    def _deliver(self, item: OutputItem) -> None:
        self._outputs.put(item)

    def _send(self, frames: list[Any]) -> None:
        self._check_alive()
        with self._send_lock:
            self._in_sync.send_multipart(frames, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(self._add_frames(request))

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """One ADD_BATCH (in parts, back to back, if big): the core schedules the batch whole."""
        if not requests:
            return
        messages = self._add_batch_messages(requests)
        self._check_alive()
        with self._send_lock:
            for frames in messages:
                self._in_sync.send_multipart(frames, copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(self._abort_frames(request_ids))

    def send_stop_verdict(self, step: int, stopped: list[str]) -> None:
        """Answer outputs whose ``stop_verdict_step`` is ``step``: abort ``stopped``, and let the core step on."""
        self._send(self._stop_verdict_frames(step, stopped))

    def get_output(self, timeout: Optional[float] = None) -> EngineCoreOutputs:
        """Next outputs from the core; blocks. Raises EngineDeadError, or TimeoutError after ``timeout``."""
        if self._closed:
            raise shut_down_error()
        return take_output(self._outputs, timeout)

    def call_utility(self, method: str, *args: Any) -> Any:
        fut: Future = Future()
        call_id, frames = self._utility_frames(fut, method, args)
        try:
            self._send(frames)
            return fut.result()
        finally:
            self._forget_call(call_id)

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._out_sync, zmq.POLLIN)
        proc_fd = self._process_fd()
        if proc_fd is not None:
            poller.register(proc_fd, zmq.POLLIN)
        next_heartbeat = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self._out_sync in events:
                    # Up to a batch of messages, then the checks below (a busy stream must not starve heartbeats).
                    for _ in range(64):
                        self._on_message(self._out_sync.recv_multipart(copy=False))
                        if not self._out_sync.poll(0):
                            break
                if self._stop.is_set():
                    return
                if proc_fd is not None and proc_fd in events:
                    # Deliver whatever the core managed to send before it died, then fail everyone.
                    while self._out_sync.poll(50):
                        self._on_message(self._out_sync.recv_multipart(copy=False))
                    self._set_dead(self._process_exit_message())
                    return
                now = time.monotonic()
                interval = self.heartbeat_interval_s
                if interval is not None and now >= next_heartbeat:
                    next_heartbeat = now + interval
                    with self._send_lock:
                        self._in_sync.send(EngineCoreRequestType.HEARTBEAT.value)
                silence = self._silence_death(now)
                if silence is not None:
                    self._set_dead(silence)
                    return
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                self._set_dead(self._death_message(f"socket error {e}"))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._dead is None:
            self._say_goodbye()
        self._finalizer()
        if self._dead is None:
            self._outputs.put(shut_down_error())
