"""Hypothesis: the scheduler's decode fast paths (`schedule` and `update_from_output`) change nothing a caller can
see (issue #14).

Each random workload (prompt lengths, EOS, stop token ids, min_tokens, ignore_eos, max_tokens, a small
max_model_len, two frontends, aborts, prefix caching, preemption, sync and async scheduling) runs twice, on a
Scheduler with its fast paths and on one with them off (`decode_fast_path = False`: every request takes the
general path). Every step's SchedulerOutput and outputs, every request's progress, placeholders, status and
blocks after each schedule, and the step in flight must be equal.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.hypothesis_profiles import max_examples
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput

EOS = 7


class TokenWorker:
    """Runs what it is told: samples once a request's known tokens are all computed; the token is a function of
    the request and the position (so both runs see the same tokens, whatever their timing), EOS now and then.
    Half the prompt chunks that do not finish their prompt come back with a token the scheduler must ignore."""

    def __init__(self, vocab: int, reverse: bool = False) -> None:
        self.vocab = vocab
        self.reverse = reverse  # return the requests in the reverse of the step's order (as a runner's rows may)
        self.known: dict[str, int] = {}  # tokens the worker knows (prompt + outputs), sampled ones included
        self.computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.known.pop(rid, None)
            self.computed.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.known[nr.req_id] = len(nr.prompt_token_ids) + len(nr.output_token_ids)
            self.computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, computed in zip(c.req_ids, c.num_computed_tokens):
            self.computed[rid] = computed
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            n = so.num_scheduled_tokens[rid]
            done = self.computed[rid] + n
            self.computed[rid] = done
            if done >= self.known[rid]:
                self.known[rid] = done + 1
                sampled.append([zlib.crc32(f"{rid}:{done}".encode()) % self.vocab or EOS])
            else:  # a prompt chunk: nothing, or (as a runner that samples every row may) a token to be ignored
                sampled.append([] if zlib.crc32(f"{rid}:{done}".encode()) % 2 else [EOS])
        if self.reverse:
            ids, sampled = ids[::-1], sampled[::-1]
        return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)


def _so_view(so: SchedulerOutput) -> tuple:
    c = so.scheduled_cached_reqs
    return (
        dict(so.num_scheduled_tokens),
        so.total_num_scheduled_tokens,
        [(n.req_id, n.block_ids, n.num_computed_tokens, n.output_token_ids) for n in so.scheduled_new_reqs],
        (list(c.req_ids), [list(b) for b in c.new_block_ids], list(c.num_computed_tokens)),
        sorted(so.finished_req_ids),
        list(so.blocks_to_swap_out),
        list(so.blocks_to_swap_in),
    )


def _step_view(st: Any) -> tuple:
    """A step in flight's requests and which of them sample, read without building a whole-step decode's lazy
    `requests` / `samplers` (so the code that relies on them staying unbuilt runs as in the engine)."""
    if st.is_lazy:
        return list(st.fast_ids), sorted(st.fast_ids) if st._sample_all else []
    return list(st.requests), sorted(st.samplers)


def _state_view(s: Scheduler) -> tuple:
    """What schedule() leaves behind: every live request's progress and status, the running order, the step in
    flight (its requests and which of them sample) and the blocks each request holds."""
    kv = s.kv_cache_manager
    return (
        [
            (rid, r.num_computed_tokens, r.num_output_placeholders, r.status, kv.get_block_ids(rid))
            for rid, r in s.requests.items()
        ],
        [r.request_id for r in s.running],
        [_step_view(st) for st in s._in_flight],
        s.num_free_blocks,
    )


def _num_tokens_out(outs: dict) -> int:
    return sum(len(o.new_token_ids) for eco in outs.values() for o in eco.outputs)


def _outs_view(outs: dict) -> dict:
    view: dict[int, Any] = {}
    for client, eco in outs.items():
        stats = eco.scheduler_stats
        view[client] = (
            [
                (
                    o.request_id,
                    list(o.new_token_ids),
                    o.finish_reason,
                    o.stop_reason,
                    o.num_cached_tokens,
                    o.error,
                    o.queued_ts != 0.0,
                    o.scheduled_ts != 0.0,
                    o.new_logprobs,
                    o.new_prompt_logprobs_tensors,
                )
                for o in eco.outputs
            ],
            (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_free_blocks, stats.num_preemptions)
            if stats is not None
            else None,
        )
    return view


request_spec = st.tuples(
    st.integers(1, 24),  # prompt length
    st.integers(0, 2),  # shared-prefix family
    st.one_of(st.none(), st.integers(1, 12)),  # max_tokens (None: up to max_model_len)
    st.integers(0, 3),  # min_tokens
    st.booleans(),  # ignore_eos
    st.lists(st.integers(1, 12), max_size=2),  # stop_token_ids
    st.integers(0, 1),  # client index
)

workloads = st.fixed_dictionaries(
    {
        "async": st.booleans(),
        "reverse": st.booleans(),
        "block_size": st.sampled_from([1, 2, 4]),
        "num_blocks": st.integers(4, 20),
        "budget": st.integers(4, 40),
        "max_num_seqs": st.integers(1, 6),
        "max_model_len": st.integers(16, 40),
        "mode": st.sampled_from(["recompute", "swap"]),
        "prefix": st.booleans(),
        "vocab": st.sampled_from([8, 13, 50]),
        "ops": st.lists(
            st.one_of(
                st.tuples(st.just("add"), request_spec),
                st.tuples(st.just("abort"), st.integers(0, 30)),
                st.tuples(st.just("step"), st.integers(1, 5)),
            ),
            min_size=1,
            max_size=30,
        ),
    }
)


def _run(w: dict, fast: bool) -> list:
    cfg = make_config(
        num_gpu_blocks=w["num_blocks"],
        block_size=w["block_size"],
        max_num_batched_tokens=w["budget"],
        max_num_seqs=w["max_num_seqs"],
        max_model_len=w["max_model_len"],
        preemption_mode=w["mode"],
        enable_prefix_caching=w["prefix"],
        num_cpu_blocks=8,
    )
    cfg.scheduler_config.async_scheduling = w["async"]
    s = Scheduler(cfg)
    s.decode_fast_path = fast
    worker = TokenWorker(w["vocab"], w["reverse"])
    trace: list = []
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    added: list[str] = []

    def step() -> None:
        if s.has_unfinished_requests():
            so = s.schedule()
            trace.append(("schedule", (_so_view(so), _state_view(s))))
            pending.append((so, worker.execute(so)))
        if pending and (not w["async"] or len(pending) == 2 or not s.has_unfinished_requests()):
            so, mro = pending.pop(0)
            before = s.num_generation_tokens
            outs = s.update_from_output(so, mro)
            # The engine's stats line counts the step's sampled tokens from this counter, not from the outputs.
            assert s.num_generation_tokens - before == _num_tokens_out(outs)
            trace.append(("update", _outs_view(outs)))
            # The prefix cache after the update: which blocks of each request are registered, and under which hashes
            # (the whole-step loop registers decoded blocks without the general path's bound over later steps).
            kv = s.kv_cache_manager
            trace.append(
                ("cached", (sorted(kv.num_cached_block.items()), sorted(kv.block_pool.cached_block_hash_to_block)))
            )

    for op in w["ops"]:
        if op[0] == "add":
            plen, family, max_tokens, min_tokens, ignore_eos, stop_ids, client = op[1]
            plen = min(plen, s.max_model_len - 1)
            if max_tokens is not None:
                min_tokens = min(min_tokens, max_tokens)
            rid = f"r{len(added)}"
            sp = SamplingParams(
                max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids
            )
            req = Request(rid, [family * 100 + i for i in range(plen)], sp, EOS, float(len(added)), client_index=client)
            s.add_request(req)
            added.append(rid)
        elif op[0] == "abort":
            if added:
                rid = added[op[1] % len(added)]
                trace.append(("abort", [r.request_id for r in s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)]))
        else:
            for _ in range(op[1]):
                step()
    for _ in range(500):
        if not s.has_unfinished_requests() and not pending:
            break
        step()
    assert not s.has_unfinished_requests() and not pending, "requests stuck"
    trace.append(("free", s.num_free_blocks))
    return trace


@settings(max_examples=max_examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads)
def test_decode_fast_paths_match_the_general_path(w):
    fast = _run(w, True)
    general = _run(w, False)
    assert fast == general
    reasons = {o[2] for kind, view in fast if kind == "update" for outs, _ in view.values() for o in outs}
    for r in reasons:
        event(f"finish reason {r}")
    if w["async"]:
        event("async")
    if any(kind == "update" and len(view) > 1 for kind, view in fast):
        event("two frontends in one step")
    if any(stats and stats[3] for kind, view in fast if kind == "update" for _, stats in view.values()):
        event("preemption")


def _long_workload(async_: bool, reverse: bool, prefix: bool, num_blocks: int = 64, mode: str = "recompute") -> dict:
    """Six requests decoding together for many steps (EOS ignored, lengths capped), two frontends, one abort while
    steps are in flight: the whole-step decode path of update_from_output (see _InFlightStep.fast_ids) runs. With
    few blocks, requests are preempted while their step is in flight (async)."""
    add = [("add", (5 + 3 * i, i % 2, 10 + 4 * i, 0, True, [], i % 2)) for i in range(6)]
    return {
        "async": async_,
        "reverse": reverse,
        "block_size": 4,
        "num_blocks": num_blocks,
        "budget": 64,
        "max_num_seqs": 6,
        "max_model_len": 40,
        "mode": mode,
        "prefix": prefix,
        "vocab": 50,
        "ops": [*add, ("step", 6), ("abort", 2), ("step", 5), ("abort", 4), ("step", 3)],
    }


@pytest.mark.parametrize("async_", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
def test_whole_step_decode_path_matches_the_general_path(async_, reverse, prefix, monkeypatch):
    """The runner may return the step's requests in another order (its rows'): the tokens must still go to their
    own requests. Counts the requests update_from_output's whole-step loop took (Scheduler.num_whole_step_requests),
    so the test cannot pass without running it."""
    taken = []
    lazy = []  # per update: was every step in flight still a whole-step decode with its lookups unbuilt?
    real = Scheduler.update_from_output

    def counting(self, so, mro):
        before = self.num_whole_step_requests
        lazy.append(all(st.is_lazy for st in self._in_flight))
        out = real(self, so, mro)
        taken.append(self.num_whole_step_requests - before)
        lazy[-1] = lazy[-1] and all(st.is_lazy for st in self._in_flight)
        return out

    monkeypatch.setattr(Scheduler, "update_from_output", counting)
    w = _long_workload(async_, reverse, prefix)
    fast = _run(w, True)
    assert sum(t > 0 for t in taken) >= 5
    # Neither schedule nor the update (its prefix-cache bound over the steps in flight included) built the steps'
    # request dicts: the whole-step decodes ran as in the engine.
    assert sum(lazy) >= 5
    assert fast == _run(w, False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("num_blocks", [14, 18, 24])
def test_whole_step_decode_path_with_preemptions_in_flight(mode, num_blocks):
    """Async, the runner's order reversed, KV cache too small for all six: a request of a whole-step decode is
    preempted while the step runs, the whole-step loop stops there and the general loop takes the rest (each
    request's tokens must still be its own)."""
    w = _long_workload(True, True, False, num_blocks, mode)
    fast = _run(w, True)
    assert fast == _run(w, False)
    assert any(stats and stats[3] for kind, view in fast if kind == "update" for _, stats in view.values())


@pytest.mark.parametrize("async_", [False, True])
def test_whole_step_decode_with_a_request_missing_from_the_output(async_):
    """A runner output without one of the step's requests (as a recovered step's may be): that request gets no
    token and the others theirs, as on the general path."""

    def run(fast: bool) -> list:
        cfg = make_config(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
        cfg.scheduler_config.async_scheduling = async_
        s = Scheduler(cfg)
        s.decode_fast_path = fast
        for i in range(3):
            s.add_request(Request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=20, ignore_eos=True), EOS, 0.0))
        worker = TokenWorker(50, reverse=True)
        trace, pending = [], []
        for n in range(8):
            so = s.schedule()
            mro = worker.execute(so)
            if n == 5:  # drop r1 from this step's output
                keep = [i for i, rid in enumerate(mro.req_ids) if rid != "r1"]
                ids = [mro.req_ids[i] for i in keep]
                mro = ModelRunnerOutput(
                    ids, {r: i for i, r in enumerate(ids)}, [mro.sampled_token_ids[i] for i in keep]
                )
            pending.append((so, mro))
            if not async_ or len(pending) == 2:
                trace.append(_outs_view(s.update_from_output(*pending.pop(0))))
            trace.append(_state_view(s))
        return trace

    fast = run(True)
    assert fast == run(False)
    assert any(outs and len(outs[0][0]) == 2 for outs in fast if isinstance(outs, dict))
