"""A ZMQ fuzzer for a real engine-core process: what a hostile peer can send, and the counts.

Shared by ``tests/reliability/test_zmq_fuzz.py`` (a few hundred cases) and
``benchmarks/soak.py`` (thousands). Every case is one message (or a short exchange) sent
by a ``FuzzPeer``: an attached one (completed HELLO with the token), a stranger (never
said HELLO), or a refused one. Hostile ADDs are well-formed and carry one field at or
beyond its limit; ``settle`` waits until the core has nothing left and says what became
of each. The caller then checks that a real client is still served and every block is free.
"""

from __future__ import annotations

import itertools
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgspec
import zmq

from vllm_lite.core.messages import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputType,
    EngineCoreRequestType,
    FinishReason,
    HandshakeReply,
    HelloRequest,
    UtilityRequest,
)
from vllm_lite.endpoints import CoreAddresses
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.core_harness import make_request
from vllm_lite.testing.fake_core import RawFrontend
from vllm_lite.testing.fuzz_report import FuzzReport

I64_MIN, I64_MAX, U64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1
F32_MAX = 3.4028234663852886e38
# Every message type but GOODBYE, which (whatever its payload) detaches the sender, as it should.
TYPES = [t.value for t in EngineCoreRequestType if t is not EngineCoreRequestType.GOODBYE]
_call_ids = itertools.count(1000)


class FuzzPeer(RawFrontend):
    """A raw DEALER pair with a random identity; sends any frames and gathers what comes back."""

    def __init__(self, ctx: zmq.Context, addresses: CoreAddresses, name: str = "fuzz") -> None:
        super().__init__(ctx, addresses, identity=uuid.uuid4().bytes)
        self.name = name
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        self.other_messages = 0  # READY/REFUSED/HEARTBEAT/utility replies seen while collecting

    def send_frames(self, frames: list[bytes]) -> None:
        self.inp.send_multipart(frames, copy=False)

    def greet(self, token: Optional[str], version: int = PROTOCOL_VERSION, timeout_s: float = 60.0) -> HandshakeReply:
        """HELLO and wait for READY or REFUSED."""
        self.send(EngineCoreRequestType.HELLO, HelloRequest(version, token, self.name))
        deadline = time.monotonic() + timeout_s
        while True:
            kind, msg = self.recv(max(0.05, deadline - time.monotonic()))
            if kind in (EngineCoreOutputType.READY, EngineCoreOutputType.REFUSED):
                return msg

    def _take(self, kind: EngineCoreOutputType, msg: Any) -> Any:
        """Keep request outputs; return a utility output if this message is one."""
        if kind is not EngineCoreOutputType.OUTPUTS:
            self.other_messages += 1
            return None
        for out in msg.outputs:
            self.outputs.setdefault(out.request_id, []).append(out)
        return msg.utility_output

    def call(self, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        """A utility call; outputs arriving meanwhile are kept. Raises on a failed call."""
        call_id = next(_call_ids)
        self.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, call_id, method, list(args)))
        deadline = time.monotonic() + timeout_s
        while True:
            util = self._take(*self.recv(max(0.05, deadline - time.monotonic())))
            if util is not None and util.call_id == call_id:
                if util.failure_message is not None:
                    raise RuntimeError(f"utility {method} failed: {util.failure_message}")
                return util.result

    def settle(self, timeout_s: float = 120.0) -> None:
        """Until the core holds no request: every output sent before that is in ``outputs``.

        The core answers a utility call after the outputs of every step before it, on this socket."""
        deadline = time.monotonic() + timeout_s
        while self.call("get_num_unfinished_requests", timeout_s=timeout_s) != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the core still has requests after {timeout_s} s")

    def silent(self) -> bool:
        """Nothing has arrived for this peer (checked after the core answered someone else later)."""
        return not self.out.poll(0)

    def close(self) -> None:
        self.inp.close(linger=0)
        self.out.close(linger=0)


# ---------------------------------------------------------------------------------------------- malformed frames


def random_object(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack-able value: what a wrong-typed payload decodes to."""
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 0:
        return rng.choice([None, True, False])
    if pick == 1:
        return rng.choice([0, -1, 1 << 40, I64_MIN, U64_MAX, rng.randint(-1000, 1000)])
    if pick == 2:
        return rng.choice([0.5, -1e308, math.nan, math.inf])
    if pick == 3:
        return "".join(rng.choice("ab\u00e9\u4e2d\U0001f600") for _ in range(rng.randrange(8)))
    if pick == 4:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(16)))
    if pick == 5:
        return "x" * rng.randrange(0, 4096)
    if pick in (6, 7):
        return [random_object(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {str(random_object(rng, 3)): random_object(rng, depth + 1) for _ in range(rng.randrange(4))}


def valid_add_frames(rid: str, prompt: list[int], max_tokens: int = 2) -> list[bytes]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [EngineCoreRequestType.ADD.value, msgspec.msgpack.encode(make_request(rid, prompt, params))]


def large_add_frames(rid: str, num_tokens: int) -> list[bytes]:
    """A valid ADD whose prompt is ``num_tokens`` ids (one byte each), built without a Python list."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    head = make_request(rid, [1], params)
    enc = msgspec.msgpack.encode
    prompt = b"\xdd" + num_tokens.to_bytes(4, "big") + b"\x01" * num_tokens  # array32 of positive fixints
    body = b"\x95" + enc(rid) + prompt + enc(head.sampling_params) + enc(head.eos_token_id) + enc(0.0)
    return [EngineCoreRequestType.ADD.value, body]


def malformed_message(rng: random.Random, case: str, rid: str) -> list[bytes]:
    """One message of the named kind (see MALFORMED_CASES)."""
    add = valid_add_frames(rid, [5, 6, 7])
    if case == "random_bytes":
        return [rng.choice(TYPES + [b"\x7f", b""]), rng.randbytes(rng.randrange(0, 2048))]
    if case == "no_frames":
        return [b""]
    if case == "type_only":
        return [rng.choice([EngineCoreRequestType.ADD.value, EngineCoreRequestType.UTILITY.value])]
    if case == "unknown_type":
        return [bytes([rng.randrange(6, 256)]), add[1]]
    if case == "long_type":
        return [EngineCoreRequestType.ADD.value * 2, add[1]]
    if case == "truncated":
        return [add[0], add[1][: rng.randrange(0, len(add[1]))]]
    if case == "bitflip":
        body = bytearray(add[1])
        pos = rng.randrange(len(body))
        body[pos] ^= 1 << rng.randrange(8)
        return [add[0], bytes(body)]
    if case == "wrong_typed":
        kind = rng.choice([t for t in TYPES if t != EngineCoreRequestType.HEARTBEAT.value])
        return [kind, msgspec.msgpack.encode(random_object(rng))]
    if case == "wrong_typed_add":  # the right shape with one slot of the wrong type
        fields = [rid, [5, 6], {"max_tokens": 2}, 2, 0.0]
        fields[rng.randrange(len(fields))] = random_object(rng, 2)
        return [EngineCoreRequestType.ADD.value, msgspec.msgpack.encode(fields)]
    if case == "extra_frames":
        return [*add, rng.randbytes(rng.randrange(1, 64)), b""]
    if case == "payload_on_heartbeat":
        return [EngineCoreRequestType.HEARTBEAT.value, rng.randbytes(32)]
    raise ValueError(case)


MALFORMED_CASES = [
    "random_bytes",
    "no_frames",
    "type_only",
    "unknown_type",
    "long_type",
    "truncated",
    "bitflip",
    "wrong_typed",
    "wrong_typed_add",
    "extra_frames",
    "payload_on_heartbeat",
]


# ---------------------------------------------------------------------------------------------- hostile ADDs


@dataclass
class HostileCase:
    """One well-formed ADD with one field set behind every frontend check."""

    field: str
    value: Any
    valid: bool  # at the limit (must run) or beyond it (must be refused: an error naming it, or dropped)
    prompt_len: int = 4


def hostile_cases(vocab: int, max_model_len: int, max_logprobs: int = 20) -> list[HostileCase]:
    """Every SamplingParams field (and the request's own) at and beyond its limit."""
    v, L = vocab, max_model_len
    table: dict[str, tuple[list[Any], list[Any]]] = {
        "n": ([1, 128], [0, 129, 10**6, -1, "2", 1.5]),
        "best_of": ([None, 128], [0, 129, 10**6]),
        "temperature": ([0.0, F32_MAX], [-0.01, math.nan, math.inf, -math.inf, "1.0"]),
        "top_p": ([1.0, 1e-9], [0.0, 1.0000001, math.nan, -1.0]),
        "top_k": ([-1, I64_MAX], [-2, I64_MIN, 1.5]),
        "min_p": ([0.0, 1.0], [1.0000001, -0.5, math.nan]),
        "presence_penalty": ([-2.0, 2.0], [2.0000001, -3.0, math.inf]),
        "frequency_penalty": ([-2.0, 2.0], [-2.0000001, 1e300, math.nan]),
        "repetition_penalty": ([F32_MAX, 1e-9], [0.0, -1.0, math.inf]),
        "seed": ([I64_MIN, U64_MAX, None], ["7", 1.5]),
        "max_tokens": ([I64_MAX, 1], [0, -1, I64_MIN]),
        "min_tokens": ([0, 3], [-1, 4, I64_MAX]),
        "logprobs": ([0, max_logprobs], [max_logprobs + 1, -1, 10**9]),
        "prompt_logprobs": ([0, max_logprobs], [max_logprobs + 1, -1]),
        "stop": ([["x" * 1024], ["s"] * 128], [[""], ["x" * 1025], ["s"] * 129, [7]]),
        "stop_token_ids": ([[v - 1] * 1024], [[v], [-1], [0] * 1025, [1 << 40]]),
        "allowed_token_ids": ([list(range(v)), [0]], [[], [v], [-1], [U64_MAX]]),
        "logit_bias": ([{0: -100.0, v - 1: 100.0}], [{v: 1.0}, {-1: 1.0}, {0: 100.5}, {0: math.nan}, {"7": 1.0}]),
        "bad_words": ([["w"] * 1024], [["w"] * 1025, [""], ["x" * 1025]]),
        "_bad_words_token_ids": ([[[v - 1]] * 2048], [[[]], [[v]], [[0, -1]], [[0]] * 2049, [[0] * (L + 1)]]),
        "priority": ([I64_MIN, I64_MAX], [I64_MAX + 1, U64_MAX]),
        "cache_salt": ([None, "s" * 1024], ["s" * 1025, 7]),
        "prompt_token_ids": ([[v - 1] * (L - 1), [0]], [[], [v], [-1], [0] * L, [U64_MAX]]),
        "eos_token_id": ([None, v - 1], [v, -1, U64_MAX]),
        "request_id": (["r" * 1024], ["", "r" * 1025]),
    }
    cases = []
    for name, (good, bad) in table.items():
        for value in good:
            long_prompt = name == "max_tokens" and value == I64_MAX  # ends at max_model_len: keep it short
            cases.append(HostileCase(name, value, True, prompt_len=L - 3 if long_prompt else 4))
        cases.extend(HostileCase(name, value, False) for value in bad)
    return cases


_REQUEST_FIELDS = {"prompt_token_ids", "eos_token_id", "priority", "cache_salt"}


def hostile_frames(case: HostileCase, rid: str) -> list[bytes]:
    """The ADD's frames; the field is set after construction, as a client skipping its checks would."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=3, ignore_eos=True)
    if case.field == "request_id":
        rid = (rid + "-" + "r" * len(case.value))[: len(case.value)]
    req = make_request(rid, [3] * case.prompt_len, params)
    if case.field in _REQUEST_FIELDS:
        setattr(req, case.field, case.value)
    elif case.field != "request_id":
        setattr(params, case.field, case.value)
    return [EngineCoreRequestType.ADD.value, msgspec.msgpack.encode(req)]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------- the fuzzer


class ZmqFuzzer:
    """Attacks one engine core at ``addresses`` (auth ``token``) with every kind of bad message."""

    def __init__(
        self,
        addresses: CoreAddresses,
        token: Optional[str],
        seed: int = 0,
        max_message_bytes: Optional[int] = None,
    ) -> None:
        self.addresses = addresses
        self.token = token
        self.rng = random.Random(seed)
        self.ctx = zmq.Context()
        self.report = FuzzReport()
        self.max_message_bytes = max_message_bytes
        self._ids = itertools.count()
        self.peer = self.attached("fuzz-main")
        facts = self._facts
        self.vocab, self.max_model_len = facts.vocab_size, facts.max_model_len

    def rid(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"

    def attached(self, name: str) -> FuzzPeer:
        peer = FuzzPeer(self.ctx, self.addresses, name)
        reply = peer.greet(self.token)
        assert reply.accepted, reply.reason
        self._facts = reply
        return peer

    def close(self) -> None:
        self.peer.close()
        self.ctx.destroy(linger=0)

    def _problem(self, text: str) -> None:
        self.report.problems.append(text)

    # ------------------------------------------------------------------ batches
    def malformed(self, n: int) -> None:
        """``n`` malformed messages, from the attached peer and from a stranger that never said HELLO."""
        stranger = FuzzPeer(self.ctx, self.addresses, "stranger")
        sent: list[str] = []
        for _ in range(n):
            case = self.rng.choice(MALFORMED_CASES)
            who = self.rng.choice(["attached", "stranger"])
            rid = self.rid(f"mal-{case}")
            (self.peer if who == "attached" else stranger).send_frames(malformed_message(self.rng, case, rid))
            self.report.tried[f"malformed:{case}"] += 1
            if who == "attached":
                sent.append(rid)
        self.peer.settle()
        for rid in sent:
            for out in self.peer.outputs.pop(rid, []):
                if out.finish_reason is not None:
                    self.report.outcomes[f"malformed->{out.finish_reason}"] += 1
        if not stranger.silent():
            self._problem("a stranger got an answer to a malformed message")
        stranger.close()

    def oversized(self, n: int, size: int) -> None:
        """``n`` messages of ``size`` bytes (beyond the core's limit): each drops its connection only."""
        for i in range(n):
            peer = self.attached(f"oversized-{i}") if i % 2 == 0 else FuzzPeer(self.ctx, self.addresses, "big")
            peer.send_frames([EngineCoreRequestType.ADD.value, b"\xc4" + b"\0" * size])
            self.report.tried["oversized"] += 1
            peer.close()
        self.peer.settle()

    def unauthenticated(self, n: int) -> None:
        """No token, wrong tokens, a wrong version; then every kind of message from the refused peers."""
        for i in range(n):
            token = [None, "wrong-" + uuid.uuid4().hex, (self.token or "") + "x", ""][i % 4]
            peer = FuzzPeer(self.ctx, self.addresses, "intruder")
            reply = peer.greet(token, version=PROTOCOL_VERSION + (100 if i % 5 == 4 else 0))
            self.report.tried["hello:bad-token-or-version"] += 1
            if reply.accepted and self.token is not None:
                self._problem(f"HELLO with token {token!r} accepted")
            rid = self.rid("intruder")
            peer.send_frames(valid_add_frames(rid, [4, 5]))
            peer.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, 1, "get_num_total_blocks", []))
            peer.send_frames([EngineCoreRequestType.ABORT.value, msgspec.msgpack.encode([rid])])
            peer.send_frames([EngineCoreRequestType.HEARTBEAT.value])
            self.report.tried["refused-peer:add+utility+abort+heartbeat"] += 1
            self._expect_silent_after_core_answered(peer, f"refused peer {i}", rid)

    def never_hello(self, n: int, add_bytes: int) -> None:
        """A peer that never says HELLO sends ADDs of ``add_bytes`` (valid msgpack): none may run."""
        peer = FuzzPeer(self.ctx, self.addresses, "stranger")
        ids = []
        for _ in range(n):
            rid = self.rid("stranger")
            peer.send_frames(large_add_frames(rid, add_bytes))
            ids.append(rid)
            self.report.tried["never-hello:large-add"] += 1
        peer.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, 1, "get_num_total_blocks", []))
        self._expect_silent_after_core_answered(peer, "never-HELLO peer", *ids)

    def _expect_silent_after_core_answered(self, peer: FuzzPeer, who: str, *rids: str) -> None:
        """After the core answered our attached peer (sent later), nothing of ``rids`` runs or answered ``peer``."""
        self.peer.settle()
        if self.peer.call("get_num_unfinished_requests") != 0:
            self._problem(f"{who}: its requests run")
        if not peer.silent():
            self._problem(f"{who}: got an answer")
        peer.close()

    def replayed(self, n: int) -> None:
        """Replays of a real ADD: by its sender while it runs and after it finished, and by a stranger."""
        stranger = FuzzPeer(self.ctx, self.addresses, "stranger")
        for _ in range(n):
            rid = self.rid("replay")
            frames = valid_add_frames(rid, [9, 8, 7], max_tokens=6)
            self.peer.send_frames(frames)
            self.peer.send_frames(frames)  # while it runs: a duplicate id
            stranger.send_frames(frames)  # from nobody: dropped
            self.peer.settle()
            outs = self.peer.outputs.pop(rid, [])
            reasons = sorted(str(o.finish_reason) for o in outs if o.finish_reason is not None)
            self.report.tried["replay:sender-while-running+stranger"] += 1
            self.report.outcomes["replay->" + "+".join(reasons)] += 1
            tokens = sum(len(o.new_token_ids) for o in outs)
            # The replay meets its original running (a duplicate-id error) or, rarely, already finished (runs anew).
            if (reasons, tokens) not in ((["error", "length"], 6), (["length", "length"], 12)):
                self._problem(f"replayed ADD {rid}: {reasons}, {tokens} tokens")
            self.peer.send_frames(frames)  # after it finished: runs again, as a new request
            self.peer.settle()
            again = [o for o in self.peer.outputs.pop(rid, []) if o.finish_reason is not None]
            self.report.tried["replay:after-finish"] += 1
            if [str(o.finish_reason) for o in again] != ["length"]:
                self._problem(f"replay after finish of {rid}: {again}")
        if not stranger.silent():
            self._problem("a stranger's replay was answered")
        stranger.close()

    def foreign_aborts(self, n: int) -> None:
        """Another tenant ABORTs our request ids (sent right behind our ADDs): ours must run to the end."""
        other = self.attached("fuzz-other")
        for _ in range(n):
            rid = self.rid("victim")
            self.peer.send_frames(valid_add_frames(rid, [9, 8, 7], max_tokens=6))
            other.send_frames([EngineCoreRequestType.ABORT.value, msgspec.msgpack.encode([rid])])
            self.peer.settle()
            outs = self.peer.outputs.pop(rid, [])
            reasons = [str(o.finish_reason) for o in outs if o.finish_reason is not None]
            self.report.tried["abort:by-another-tenant"] += 1
            self.report.outcomes["foreign-abort->" + ("+".join(reasons) or "nothing")] += 1
            if reasons != ["length"] or sum(len(o.new_token_ids) for o in outs) != 6:
                self._problem(f"another tenant's ABORT changed {rid}: finish {reasons or 'never (no output)'}")
        if other.outputs:
            self._problem("the aborting tenant got outputs of a request it does not own")
        other.close()

    def hostile(self, cases: Optional[list[HostileCase]] = None) -> None:
        """Well-formed ADDs with one field at or beyond its limit: the valid run, the rest never do."""
        cases = cases if cases is not None else hostile_cases(self.vocab, self.max_model_len)
        sent = []
        for case in cases:
            rid = self.rid(f"h-{case.field.strip('_')}")
            frames = hostile_frames(case, rid)
            if case.field == "request_id":
                rid = msgspec.msgpack.decode(frames[1])[0]
            self.peer.send_frames(frames)
            sent.append((rid, case))
            self.report.tried[f"hostile:{case.field.strip('_')}:{'at' if case.valid else 'beyond'}"] += 1
        self.peer.settle()
        for rid, case in sent:
            outs = self.peer.outputs.pop(rid, [])
            final = outs[-1] if outs else None
            if final is None:
                outcome = "dropped"  # the socket loop could not decode it as an ADD
            elif final.finish_reason == FinishReason.ERROR:
                outcome = "error"
                name = case.field.strip("_")
                if name not in (final.error or "") and case.field != "request_id":
                    self._problem(f"{case.field}={_short(case.value)}: error does not name it: {final.error}")
            else:
                outcome = "ran"
            self.report.outcomes[f"{'at' if case.valid else 'beyond'}->{outcome}"] += 1
            if case.valid and outcome != "ran":
                self._problem(f"{case.field}={_short(case.value)} (at the limit) did not run: {outcome} {final}")
            if not case.valid and outcome == "ran":
                self._problem(f"{case.field}={_short(case.value)} (beyond the limit) ran")

    def check_clean(self) -> tuple[int, int]:
        """(free, total) blocks once idle; a problem if any request or block is left."""
        self.peer.settle()
        free, total = self.peer.call("get_num_free_blocks"), self.peer.call("get_num_total_blocks")
        if free != total:
            self._problem(f"KV block leak: {free} free of {total}")
        return free, total


def run_all(fuzzer: ZmqFuzzer, scale: int, on_batch: Optional[Callable[[str], None]] = None) -> FuzzReport:
    """Every attack once at ``scale`` (1: CI-sized); ``on_batch(name)`` runs after each (health checks)."""
    batches: list[tuple[str, Callable[[], None]]] = [
        ("malformed", lambda: fuzzer.malformed(120 * scale)),
        ("unauthenticated", lambda: fuzzer.unauthenticated(8 * scale)),
        ("never-hello", lambda: fuzzer.never_hello(4 * scale, 1 << 20)),
        ("replayed", lambda: fuzzer.replayed(3 * scale)),
        ("foreign-aborts", lambda: fuzzer.foreign_aborts(3 * scale)),
        ("hostile", lambda: [fuzzer.hostile() for _ in range(scale)]),
        ("oversized", lambda: fuzzer.oversized(2, (fuzzer.max_message_bytes or (32 << 20)) + 1024)),
    ]
    for name, batch in batches:
        batch()
        fuzzer.check_clean()
        if on_batch is not None:
            on_batch(name)
    return fuzzer.report
