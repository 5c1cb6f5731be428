"""The engine core in its own process, serving frontends over ZMQ: the busy loop and its wiring.

The parts, one job each:

* ``core_sockets.CoreSockets``: the two ROUTER sockets, their threads, typed decode/encode
  (the wire protocol is described there);
* ``client_registry.ClientRegistry``: attached frontends (HELLO and auth checks, client
  indices, heartbeats, dropped-frontend memory) and which live request belongs to whom;
* ``shutdown.ShutdownState``: running -> draining(deadline) -> stopped;
* ``EngineCoreProc`` (here): the busy loop that wires them to an ``EngineCore``.

Routing is by identity: the core overwrites every request's ``client_index`` with the
sender's (a frontend cannot receive another's outputs) and sends each client only its own
outputs. A frontend must HELLO before anything else; messages from unknown identities are
dropped.

Busy loop (main thread): drain the input queue (HELLOs, then ABORTs -- the fast path -- then
ADDs, ADD_BATCHes and UTILITY calls in arrival order, then GOODBYEs), ``step()``, route outputs per
client; block on the input queue when idle. While a frontend's ADD_BATCH is still arriving in parts
the loop does not step (for ``BATCH_HOLD_S`` at most), so an offline batch is scheduled whole.

Stop verdicts (offline determinism): a request flagged ``await_stop_verdict`` (an offline frontend's request
with stop strings, which only the frontend can match) that got a token in a step, while other requests are
live, makes that frontend's outputs carry ``stop_verdict_step``; the loop then does not step until that
frontend's ``StopVerdict`` for it has come and its stopped requests are aborted, so they leave the batch at
the same step every run. It waits only while every frontend with live requests awaits a verdict: other
frontends never stall. A lone request (batch 1) shares no step with another, so it never waits.

Lifecycle: SIGTERM stops new work, drains running requests for at most ``drain_timeout_s``,
aborts the rest and exits 0. A fatal error in the loop sends ``EngineCoreOutputs(engine_dead=True)``
to every frontend and exits 1. A frontend silent for longer than ``heartbeat_timeout_s`` (any
message counts) is dropped and its requests aborted (with ABORT outputs sent to it, in case it
was only slow; if it speaks again it is taken back). A frontend whose connection closes (its
process died: the socket monitor reports it at once) is dropped the same way. GOODBYE detaches at once.

The process is started by ``vllm_lite.launcher`` (``python -m vllm_lite.core.engine_core_main``,
arguments ``EngineCoreArgs``); ``run_engine_core`` answers ``EngineCoreReady`` or the start-up
error with its traceback, and the launcher ends the process when its parent dies.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import secrets
import signal
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm_lite import envs, process_watch
from vllm_lite.config import VllmConfig, decode_vllm_config
from vllm_lite.core.client_registry import AttachedClient, ClientRegistry
from vllm_lite.core.core_sockets import CoreSockets, InputItem, SocketEvent, max_input_message_bytes
from vllm_lite.core.gc_heap import freeze_gc_heap, gc_state
from vllm_lite.core.messages import (
    EngineCoreArgs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    HandshakeReply,
    HelloRequest,
    StopVerdict,
    UtilityOutput,
    UtilityRequest,
)
from vllm_lite.core.shutdown import Phase, ShutdownState
from vllm_lite.core.thread_policy import AdaptiveThreads, ThreadPinner, usable_cpus
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.log_limiter import LogLimiter

if TYPE_CHECKING:
    from vllm_lite.launcher_child import ChildChannel

logger = logging.getLogger(__name__)

# How often the idle loop wakes to check heartbeats, the parent and signals.
_IDLE_POLL_S = 0.2
# The longest the loop holds its steps for a frontend whose ADD_BATCH has more parts to come: the parts
# are sent back to back, so this only bounds what a stalled or hostile frontend can cost the others.
BATCH_HOLD_S = 5.0


@dataclass
class CoreProcOptions:
    """Knobs of the serving process (not of the model)."""

    # None: any frontend may attach. Else HELLO must carry this token.
    auth_token: Optional[str] = None
    # Drop a frontend (abort its requests) after this much silence; None or 0: never.
    heartbeat_timeout_s: Optional[float] = 10.0
    # On SIGTERM, let running requests finish for at most this long.
    drain_timeout_s: float = 30.0
    # SIGINT too stops the core (daemon). A private core ignores it: its parent decides.
    handle_sigint: bool = False
    # Listening sockets a parent bound for us (input, output): served on instead of binding again.
    input_fd: Optional[int] = None
    output_fd: Optional[int] = None
    # ZMQ_MAXMSGSIZE of the input socket; None: $VLLM_LITE_MAX_MESSAGE_BYTES, else sized from the model.
    max_message_bytes: Optional[int] = None


def set_core_thread_policy(vllm_config: VllmConfig) -> tuple[int, Optional[AdaptiveThreads]]:
    """Set torch intra-op threads for the engine core process: the number, and the adapter that moves it.

    DeviceConfig.num_threads wins and stays. Otherwise, on CPU the core starts on every core it may
    run on but one (left for the frontends) and, with one model process (no tensor parallel ranks), follows
    what other processes use between steps (core/thread_policy.py): OpenMP threads that must share a core
    with a busy process run decode-sized matmuls 2-20x slower than one with a core to itself, while a
    second thread on an idle core is worth ~15%. While it uses every core, its threads are bound one per core
    ($VLLM_CPU_OMP_THREADS_BIND=nobind: never). With an accelerator the CPU does little math, so 1 thread.
    """
    n = vllm_config.device_config.num_threads
    adaptive = None
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_threads must be a positive integer, got {n!r}.")
    elif vllm_config.device_config.device.type == "cpu":
        cpus = usable_cpus()
        n = max(1, len(cpus) - 1)
        if envs.VLLM_LITE_ADAPTIVE_THREADS and vllm_config.parallel_config.tensor_parallel_size == 1:
            # One model process: its threads may be bound one per core whenever it uses them all.
            mode = envs.VLLM_CPU_OMP_THREADS_BIND
            if mode not in ("auto", "nobind"):
                logger.warning(
                    "VLLM_CPU_OMP_THREADS_BIND=%r: CPU lists are not supported here; binding as 'auto' "
                    "(one thread per core this process may use). Set it to 'nobind' to turn binding off.",
                    mode,
                )
            bind = mode != "nobind"
            set_threads = ThreadPinner(cpus, torch.set_num_threads) if bind else torch.set_num_threads
            adaptive = AdaptiveThreads(cpus, n, set_threads)
            set_threads(n)
            return n, adaptive
    else:
        n = 1
    torch.set_num_threads(n)
    return n, adaptive


class EngineCoreProc:
    """Wraps an EngineCore with sockets, a client registry, a shutdown state and the busy loop."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        addresses: CoreAddresses,
        options: Optional[CoreProcOptions] = None,
    ) -> None:
        self.options = options or CoreProcOptions()
        self.addresses = addresses
        self.num_threads, self._adaptive_threads = set_core_thread_policy(vllm_config)
        self._model_path = vllm_config.model_config.model
        self._tokenizer = vllm_config.model_config.tokenizer
        # Other nodes' tensor-parallel ranks prove the same token as frontends (worker/rendezvous_gate.py).
        pc = vllm_config.parallel_config
        if pc.rendezvous_token is None:
            pc.rendezvous_token = self.options.auth_token
        # --prefix-caching-scope client: a key that never leaves this process, for per-frontend cache salts.
        scope = vllm_config.cache_config.prefix_caching_scope
        self._tenant_key = secrets.token_bytes(32) if scope == "client" else None
        drop_log = LogLimiter(logger)  # shared by the input thread and the loop; races only miscount
        self.registry = ClientRegistry(self.options.auth_token, drop_log)
        self.shutdown_state = ShutdownState(self.options.drain_timeout_s)
        self._last_housekeeping = 0.0
        # Frontends whose ADD_BATCH has more parts to come -> when the loop stops waiting for them.
        self._open_batches: dict[bytes, float] = {}
        # Live requests flagged await_stop_verdict, and frontend -> the stop_verdict_step we wait for it to answer.
        self._verdict_ids: set[str] = set()
        self._awaited_verdicts: dict[bytes, int] = {}
        self._verdict_step = 0
        # Sent in every READY: a frontend on this host watches our process instead of waiting on heartbeats.
        self._host_id, self._started = process_watch.host_id(), process_watch.start_ticks(os.getpid())
        self.sockets = CoreSockets(
            addresses,
            self.registry.touch,
            drop_log,
            input_fd=self.options.input_fd,
            output_fd=self.options.output_fd,
            may_return=self.registry.was_dropped,
            max_message_bytes=self._max_message_bytes(vllm_config),
        )
        # Sockets first (a busy port fails in milliseconds, not after loading the model); frontends
        # that connect meanwhile wait in the input queue until the loop starts.
        try:
            self.engine_core = self._make_engine_core(vllm_config)
            self.model_facts: dict[str, Any] = dict(self.engine_core.model_facts)
        except BaseException:
            self.sockets.stop()
            raise

    def _max_message_bytes(self, vllm_config: VllmConfig) -> int:
        """The largest message a frontend may send (a bigger one drops its connection)."""
        if self.options.max_message_bytes is not None:
            return int(self.options.max_message_bytes)
        configured = int(envs.VLLM_LITE_MAX_MESSAGE_BYTES)
        if configured > 0:
            return configured
        model = vllm_config.model_config
        vocab = model.hf_config.get("vocab_size", 0)
        return max_input_message_bytes(int(model.max_model_len or 0), vocab if isinstance(vocab, int) else 0)

    def _make_engine_core(self, vllm_config: VllmConfig) -> Any:
        """The engine this process serves (a subclass may serve another with EngineCore's interface)."""
        from vllm_lite.core.engine_core import EngineCore

        return EngineCore(vllm_config)

    def ready_message(self, vllm_config: VllmConfig) -> EngineCoreReady:
        """What the launcher tells our parent once we serve."""
        import vllm_lite

        facts = self.model_facts
        return EngineCoreReady(
            model=str(facts.get("model", "")),
            model_path=self._model_path,
            tokenizer=self._tokenizer,
            max_model_len=int(facts.get("max_model_len", 0)),
            block_size=int(facts.get("block_size", 0)),
            num_gpu_blocks=int(facts.get("num_gpu_blocks", 0)),
            num_cpu_blocks=int(vllm_config.cache_config.num_cpu_blocks or 0),
            vocab_size=int(facts.get("vocab_size", 0)),
            vllm_lite_version=str(vllm_lite.__version__),
            torch_version=str(torch.__version__),
        )

    def install_signal_handlers(self) -> None:
        """SIGTERM (and SIGINT for a daemon): stop taking work, drain, exit 0. Main thread only."""
        self.shutdown_state.install_signal_handlers(self.options.handle_sigint)

    def request_shutdown(self) -> None:
        """Same as SIGTERM, callable from any thread (tests, an embedding server)."""
        self.shutdown_state.request()

    # ------------------------------------------------------------------ busy loop
    def run_busy_loop(self) -> int:
        """Serve until told to stop; return the process exit code (0 clean, 1 fatal)."""
        try:
            while True:
                self._process_input(
                    block=self._batch_open()
                    or self._awaiting_verdict()
                    or not self.engine_core.has_unfinished_requests()
                )
                self._housekeeping()
                if self.shutdown_state.advance(self.engine_core.has_unfinished_requests()) is Phase.STOPPED:
                    if self.shutdown_state.drain_expired:
                        self._abort_all("the engine core shut down before the request finished")
                    break
                if (
                    self.engine_core.has_unfinished_requests()
                    and not self._batch_open()
                    and not self._awaiting_verdict()
                ):
                    if self._adaptive_threads is not None:  # after an idle spell: measure from here
                        self._adaptive_threads.before_step()
                    self._route_outputs(self._step())
                    if self._adaptive_threads is not None:
                        self.num_threads = self._adaptive_threads.maybe_update()
        except BaseException:  # noqa: BLE001 -- any failure here kills the engine, loudly
            logger.error("Fatal error in the engine core busy loop:\n%s", traceback.format_exc())
            self._close(dead=True)
            return 1
        self._close(dead=False)
        return 0

    def _step(self) -> dict[int, EngineCoreOutputs]:
        """One engine step. With async scheduling, requests waiting for stop verdicts make it synchronous: each
        such request must leave the batch at the step its verdict names, as without async scheduling."""
        if self._verdict_ids and getattr(self.engine_core, "async_scheduling", False):
            return self.engine_core.step(allow_overlap=False)
        return self.engine_core.step()

    def _process_input(self, block: bool) -> None:
        items = self._take_input(block)
        # Requests that an ABORT later in this batch, from the same frontend, cancels: never add them.
        # Keyed by sender too: another tenant naming my request id must not cancel it.
        aborted_after: dict[tuple[bytes, str], int] = {}
        for pos, (identity, kind, payload) in enumerate(items):
            if kind is EngineCoreRequestType.HELLO:
                self._handle_hello(identity, payload)
            elif kind is EngineCoreRequestType.HEARTBEAT:
                if self.registry.lookup(identity, "HEARTBEAT") is not None:
                    self.sockets.send(identity, EngineCoreOutputType.HEARTBEAT)
            elif kind is EngineCoreRequestType.ABORT:
                for rid in payload:
                    aborted_after[(identity, rid)] = pos
        for identity, kind, payload in items:
            if kind is EngineCoreRequestType.ABORT:
                self._handle_abort(identity, payload)
            elif kind is EngineCoreRequestType.STOP_VERDICT:
                self._handle_stop_verdict(identity, payload)
        for pos, (identity, kind, payload) in enumerate(items):
            if kind is EngineCoreRequestType.ADD:
                if aborted_after.get((identity, payload.request_id), -1) > pos:
                    continue
                self._handle_add(identity, payload)
            elif kind is EngineCoreRequestType.ADD_BATCH:
                for request in payload.requests:
                    if aborted_after.get((identity, request.request_id), -1) <= pos:
                        self._handle_add(identity, request)
                self._batch_part(identity, payload.more)
            elif kind is EngineCoreRequestType.UTILITY:
                self._handle_utility(identity, payload)
        for identity, kind, _ in items:
            if kind is EngineCoreRequestType.GOODBYE:
                client = self.registry.get(identity)
                if client is not None:
                    self._drop_client(client, "it said GOODBYE", may_return=False)
            elif kind is SocketEvent.DISCONNECTED:
                client = self.registry.get(identity)
                if client is not None:  # may come back (a reconnect after a network blip): remembered
                    self._drop_client(client, "its connection closed")

    def _batch_part(self, identity: bytes, more: bool) -> None:
        """Book one part of an ADD_BATCH: hold steps for this frontend's next part, or stop holding."""
        if more and self.registry.get(identity) is not None:
            self._open_batches[identity] = time.monotonic() + BATCH_HOLD_S
        else:
            self._open_batches.pop(identity, None)

    def _batch_open(self) -> bool:
        """True while some frontend's ADD_BATCH has parts to come (each waited for BATCH_HOLD_S at most)."""
        if self._open_batches:
            now = time.monotonic()
            for identity in [i for i, deadline in self._open_batches.items() if deadline <= now]:
                logger.warning("An ADD_BATCH from %s stopped before its last part; stepping on.", identity.hex())
                del self._open_batches[identity]
        return bool(self._open_batches)

    def _awaiting_verdict(self) -> bool:
        """True while the next step waits for a StopVerdict: some frontend owes one and every frontend with
        live requests does (one with live requests and no verdict due is never held up by another's)."""
        if not self._awaited_verdicts:
            return False
        waiting = False
        for client in self.registry.clients():
            if client.request_ids:
                if client.identity not in self._awaited_verdicts:
                    return False
                waiting = True
        return waiting

    def _handle_stop_verdict(self, identity: bytes, verdict: StopVerdict) -> None:
        """A frontend's answer for the outputs of step ``verdict.step``: abort what its stop strings ended."""
        if verdict.stopped:
            self._handle_abort(identity, verdict.stopped)
        if self._awaited_verdicts.get(identity, verdict.step + 1) <= verdict.step:
            del self._awaited_verdicts[identity]

    def _forget_verdict_ids(self, request_ids: list[str]) -> None:
        if self._verdict_ids:
            self._verdict_ids.difference_update(request_ids)

    def _take_input(self, block: bool) -> list[InputItem]:
        """Everything queued now; when ``block``, wait a little for the first item."""
        items: list[InputItem] = []
        q = self.sockets.input_queue
        if block:
            try:
                items.append(q.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return items
        # The queue's own deque, read without its lock (this loop is its only reader): an item the input thread
        # has put is in it. A busy step finds it empty, so no get_nowait raising queue.Empty every step.
        while q.queue:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                break
        return items

    def _handle_hello(self, identity: bytes, hello: HelloRequest) -> None:
        client, reason = self.registry.hello(identity, hello, accepting=not self.shutdown_state.requested)
        if client is None:
            self.sockets.send(identity, EngineCoreOutputType.REFUSED, HandshakeReply(accepted=False, reason=reason))
            return
        facts = self.model_facts
        reply = HandshakeReply(
            accepted=True,
            client_index=client.index,
            model=str(facts.get("model", "")),
            max_model_len=int(facts.get("max_model_len", 0)),
            block_size=int(facts.get("block_size", 0)),
            num_gpu_blocks=int(facts.get("num_gpu_blocks", 0)),
            vocab_size=int(facts.get("vocab_size", 0)),
            heartbeat_timeout_s=float(self.options.heartbeat_timeout_s or 0.0),
            model_path=self._model_path,
            tokenizer=self._tokenizer,
            max_logprobs=int(facts.get("max_logprobs", 20)),
            generation_config=str(facts.get("generation_config", "auto")),
            runner_type=str(facts.get("runner_type", "generate")),
            convert_type=str(facts.get("convert_type", "auto")),
            pooler_config=facts.get("pooler_config"),
            lora_config=facts.get("lora_config"),
            core_pid=os.getpid(),
            core_host=self._host_id,
            core_started=self._started,
        )
        self.sockets.send(identity, EngineCoreOutputType.READY, reply)

    def _handle_abort(self, identity: bytes, request_ids: list[str]) -> None:
        client = self.registry.lookup(identity, "ABORT")
        if client is None:
            return
        mine = self.registry.mine(client, request_ids)
        if mine:
            self.engine_core.abort_requests(mine)
            for rid in mine:
                self.registry.release(rid)
            self._forget_verdict_ids(mine)

    def _handle_add(self, identity: bytes, request: EngineCoreRequest) -> None:
        client = self.registry.lookup(identity, f"ADD {request.request_id!r}")
        if client is None:
            return
        rid = request.request_id
        if self.shutdown_state.requested:
            return self._reject(client, rid, "the engine core is shutting down and takes no new requests")
        if self.registry.owner(rid) is not None:
            return self._reject(client, rid, f"duplicate request id {rid!r}: a request with this id is still running")
        request.client_index = client.index
        try:
            self.engine_core.add_request(request, tenant_salt=self._tenant_salt(client))
        except (ValueError, TypeError) as e:
            return self._reject(client, rid, f"{type(e).__name__}: {e}")
        self.registry.own(client, rid)
        if request.await_stop_verdict:
            self._verdict_ids.add(rid)

    def _tenant_salt(self, client: AttachedClient) -> Optional[bytes]:
        """The prefix-cache salt of a frontend: a keyed hash of the ZMQ identity that passed HELLO.

        Derived here, never read from the wire, so no frontend can claim another's cached prefixes;
        the identity is stable, so a frontend keeps its own prefixes (n>1, repeats, after a re-attach).
        """
        if self._tenant_key is None:
            return None
        return hmac.new(self._tenant_key, client.identity, hashlib.sha256).digest()[:16]

    def _reject(self, client: AttachedClient, request_id: str, message: str) -> None:
        logger.warning("Request %r from client %d failed: %s", request_id, client.index, message)
        out = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=message)
        self._send_outputs(client, EngineCoreOutputs(outputs=[out]))

    def _handle_utility(self, identity: bytes, call: UtilityRequest) -> None:
        client = self.registry.lookup(identity, f"UTILITY {call.method!r}")
        if client is None:
            return
        try:
            if call.method == "list_frontends":  # the serving process's own facts, not the engine's
                value: Any = self.registry.list_frontends()
            elif call.method == "get_gc_state":  # this process's garbage collector (frozen at start-up)
                value = gc_state()
            else:
                value = self.engine_core.call_utility(call.method, list(call.args))
            result = UtilityOutput(call.call_id, result=value)
        except Exception as e:  # noqa: BLE001 -- a failed utility call fails only that call
            result = UtilityOutput(call.call_id, failure_message=str(e), failure_type=type(e).__name__)
        # The call drained the steps in flight (async scheduling): their outputs go out before the answer, so a
        # client hears of every step before its call first (as without async scheduling).
        for outputs in self.engine_core.take_ready_outputs():
            self._route_outputs(outputs)
        self._send_outputs(client, EngineCoreOutputs(utility_output=result))

    def _send_outputs(self, client: AttachedClient, outs: EngineCoreOutputs) -> None:
        self.sockets.send(client.identity, EngineCoreOutputType.OUTPUTS, outs)

    def _route_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        for outs in outputs.values():
            for out in outs.outputs:
                if out.finish_reason is not None:
                    self.registry.release(out.request_id)
                    if self._verdict_ids:
                        self._verdict_ids.discard(out.request_id)
        # A verdict matters only where a stopped request would share further steps with another request: a
        # lone one (batch 1) steps on, and its frontend's ABORT still comes before that frontend's next ADD.
        ask = bool(self._verdict_ids) and self._more_than_one_live_request()
        for index, outs in outputs.items():
            client = self.registry.by_index(index)
            if client is None:  # that frontend has left; its requests were aborted
                continue
            if ask and any(
                o.finish_reason is None and o.new_token_ids and o.request_id in self._verdict_ids for o in outs.outputs
            ):  # its frontend may find a stop string in this token
                self._verdict_step += 1
                outs.stop_verdict_step = self._verdict_step
                self._awaited_verdicts[client.identity] = self._verdict_step
            self._send_outputs(client, outs)

    def _more_than_one_live_request(self) -> bool:
        n = 0
        for client in self.registry.clients():
            n += len(client.request_ids)
            if n > 1:
                return True
        return False

    def _abort_and_tell(self, client: AttachedClient, ids: list[str], message: str) -> None:
        """Abort ``ids`` in the engine and tell their frontend why they ended."""
        if not ids:
            return
        self.engine_core.abort_requests(ids)
        self._forget_verdict_ids(ids)
        outs = [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT, error=message) for rid in ids]
        self._send_outputs(client, EngineCoreOutputs(outputs=outs))

    def _abort_all(self, message: str) -> None:
        """Abort every live request, telling each frontend which of its requests ended."""
        for client, ids in self.registry.release_all():
            self._abort_and_tell(client, ids, message)

    def _housekeeping(self) -> None:
        """At most a few times a second: socket threads alive? frontends alive?"""
        now = time.monotonic()
        if now - self._last_housekeeping < _IDLE_POLL_S:
            return
        self._last_housekeeping = now
        self.registry.drop_log.flush()  # what the rate limit held back shows up even if the spray stopped
        if not self.sockets.alive():
            raise RuntimeError("an engine core socket thread died (see its traceback above)")
        timeout = self.options.heartbeat_timeout_s
        if not timeout:
            return
        for client, silent_s in self.registry.silent(timeout, now):
            self._drop_client(client, f"silent for {silent_s:.1f} s (heartbeat timeout {timeout} s)")

    def _drop_client(self, client: AttachedClient, why: str, may_return: bool = True) -> None:
        logger.warning(
            "Dropping frontend %r (client %d): %s; aborting its %d requests.",
            client.name,
            client.index,
            why,
            len(client.request_ids),
        )
        self._open_batches.pop(client.identity, None)
        self._awaited_verdicts.pop(client.identity, None)
        ids = self.registry.drop(client, may_return)
        # If it is alive after all, it learns why its requests ended instead of waiting forever.
        self._abort_and_tell(client, ids, f"aborted by the engine core: this frontend was dropped ({why})")

    def _close(self, dead: bool) -> None:
        if dead:
            for client in self.registry.clients():
                self._send_outputs(client, EngineCoreOutputs(engine_dead=True))
        # The output thread flushes everything queued before the stop marker, then stops.
        self.sockets.stop()
        try:
            self.engine_core.shutdown()
        except Exception:  # noqa: BLE001 -- we are exiting anyway
            logger.exception("EngineCore.shutdown() failed.")


def run_engine_core(args: EngineCoreArgs, channel: "ChildChannel", proc_cls: type = EngineCoreProc) -> int:
    """An engine-core process's life: build the core, answer ready (or the start-up error), serve.

    Returns the exit code (0 clean, 1 fatal); ``launcher.run_child`` exits with it.
    """
    stop_early = {"flag": False}

    def early_term(signum: int, frame: Any) -> None:
        stop_early["flag"] = True
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, early_term)
    if not args.handle_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    options = CoreProcOptions(
        auth_token=args.auth_token,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        handle_sigint=args.handle_sigint,
        input_fd=args.input_fd,
        output_fd=args.output_fd,
    )
    try:
        vllm_config = decode_vllm_config(args.vllm_config)
        proc = proc_cls(vllm_config, CoreAddresses(args.input_address, args.output_address), options)
    except BaseException as e:  # noqa: BLE001 -- every start-up failure goes to the parent
        if isinstance(e, SystemExit) and stop_early["flag"]:
            return 0
        logger.error("Engine core failed to start:\n%s", traceback.format_exc())
        channel.failed(e)
        return 1
    proc.install_signal_handlers()
    channel.ready(proc.ready_message(vllm_config))
    # This process is the core's alone: its whole start-up heap, collected first, is frozen for good (the
    # frontend is told it is ready first; what it sends meanwhile waits in the input queue).
    freeze_gc_heap()
    return proc.run_busy_loop()
