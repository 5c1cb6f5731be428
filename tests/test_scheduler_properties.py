"""Hypothesis: random add/abort/step workloads against a fake worker that keeps a fake KV cache.

The fake worker applies each SchedulerOutput exactly as a real one must (drop
finished ids, run swaps, add new requests, extend cached ones) and stores, per
KV slot, the token whose K/V would live there. Before every forward it checks
that each scheduled request's context is really in its blocks: this catches
wrong prefix-cache hits, blocks shared while being written, bad swaps and
stale block tables, not only bookkeeping slips.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.hypothesis_profiles import max_examples
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput


@dataclass
class _WorkerReq:
    tokens: list[int]
    blocks: list[int]
    computed: int


class FakeWorker:
    def __init__(self, block_size: int, eos: int) -> None:
        self.bs = block_size
        self.eos = eos
        self.kv: dict[int, list] = {}  # device block id -> tokens per slot
        self.host: dict[int, list] = {}
        self.reqs: dict[str, _WorkerReq] = {}

    def _slot(self, r: _WorkerReq, pos: int) -> tuple[int, int]:
        return r.blocks[pos // self.bs], pos % self.bs

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            assert rid in self.reqs, f"worker told to drop {rid} it never had"
            del self.reqs[rid]
        for d, h in so.blocks_to_swap_out:
            self.host[h] = list(self.kv.get(d, [None] * self.bs))
        for h, d in so.blocks_to_swap_in:
            self.kv[d] = list(self.host[h])
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs, f"{nr.req_id} sent as new while in the batch"
            assert 0 not in nr.block_ids, "null block handed out"
            self.reqs[nr.req_id] = _WorkerReq(
                nr.prompt_token_ids + nr.output_token_ids, list(nr.block_ids), nr.num_computed_tokens
            )
        c = so.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            r = self.reqs[rid]
            assert r.computed == computed, f"{rid}: worker computed {r.computed}, scheduler says {computed}"
            assert 0 not in new_blocks
            r.blocks += new_blocks
        assert set(so.num_scheduled_tokens) == {nr.req_id for nr in so.scheduled_new_reqs} | set(c.req_ids)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = self.reqs[rid]
            n = so.num_scheduled_tokens[rid]
            assert n >= 1 and r.computed + n <= len(r.tokens)
            # The context must already be in the cache.
            for pos in range(r.computed):
                b, o = self._slot(r, pos)
                assert self.kv[b][o] == r.tokens[pos], f"{rid}: wrong KV at position {pos}"
            for pos in range(r.computed, r.computed + n):
                b, o = self._slot(r, pos)
                self.kv.setdefault(b, [None] * self.bs)[o] = r.tokens[pos]
            r.computed += n
            if r.computed == len(r.tokens):
                # Deterministic "model": the next token depends on the context, EOS now and then.
                tok = (sum(r.tokens[-3:]) * 31 + len(r.tokens)) % 50
                tok = self.eos if tok == 0 else tok
                r.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def check_invariants(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    pool = kv.block_pool
    holders: dict[int, int] = {}
    for rid, blocks in kv.req_to_blocks.items():
        assert s.get_request(rid) is not None and s.get_request(rid).status == RequestStatus.RUNNING
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free_ids = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    assert len(free_ids) == pool.get_num_free_blocks()
    for b in pool.blocks[1:]:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == holders.get(b.block_id, 0), f"block {b.block_id} ref_cnt {b.ref_cnt}"
        assert (b.block_id in free_ids) == (b.ref_cnt == 0), f"block {b.block_id} free and in use"
    assert 0 not in free_ids and pool.blocks[0].ref_cnt == 0
    used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert used + pool.get_num_free_blocks() == s.num_total_blocks
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
    host_used = sum(len(v) for v in kv.req_to_host_blocks.values())
    assert host_used + kv.host_pool.get_num_free_blocks() == kv.host_pool.num_usable_blocks
    for rid in kv.req_to_host_blocks:
        assert s.get_request(rid).status == RequestStatus.SWAPPED
    assert len(s.running) <= s.max_num_seqs
    for r in s.running:
        assert r.num_computed_tokens <= r.num_tokens <= s.max_model_len


workloads = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "num_blocks": st.integers(1, 16),
        "budget": st.integers(1, 40),
        "max_num_seqs": st.integers(1, 6),
        "threshold": st.sampled_from([0, 0, 3]),
        "policy": st.sampled_from(["fcfs", "priority"]),
        "mode": st.sampled_from(["recompute", "swap"]),
        "cpu_blocks": st.integers(0, 16),
        "prefix": st.booleans(),
        "initial": st.lists(
            st.tuples(st.just("add"), st.integers(1, 30), st.integers(0, 3), st.integers(1, 20), st.integers(0, 2)),
            min_size=0,
            max_size=8,
        ),
        "ops": st.lists(
            st.one_of(
                st.tuples(
                    st.just("add"),
                    st.integers(1, 30),  # prompt length
                    st.integers(0, 3),  # shared-prefix family
                    st.integers(1, 20),  # max_tokens
                    st.integers(0, 2),  # priority
                ),
                st.tuples(st.just("abort"), st.integers(0, 30)),
                st.tuples(st.just("step"), st.integers(1, 4)),
            ),
            min_size=1,
            max_size=40,
        ),
    }
)


@settings(max_examples=max_examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads)
def test_random_workloads_keep_block_accounting_and_budget_and_drain(w):
    bs = w["block_size"]
    max_model_len = 32
    num_gpu_blocks = w["num_blocks"] + 1  # the cache may be smaller than max_model_len: the scheduler caps it
    cfg = make_config(
        num_gpu_blocks=num_gpu_blocks,
        block_size=bs,
        max_num_batched_tokens=w["budget"],
        max_num_seqs=w["max_num_seqs"],
        max_model_len=max_model_len,
        policy=w["policy"],
        preemption_mode=w["mode"],
        enable_prefix_caching=w["prefix"],
        num_cpu_blocks=w["cpu_blocks"],
        long_prefill_token_threshold=w["threshold"],
    )
    s = Scheduler(cfg)
    eos = 999
    worker = FakeWorker(bs, eos)
    added: list[str] = []
    ended: set[str] = set()
    t = 0.0

    def do_step() -> None:
        so = s.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens
        check_invariants(s)
        if so.blocks_to_swap_out:
            event("swap out")
        if so.blocks_to_swap_in:
            event("swap in")
        if any(nr.num_computed_tokens and not nr.output_token_ids for nr in so.scheduled_new_reqs):
            event("prefix cache hit")
        if so.finished_req_ids & {nr.req_id for nr in so.scheduled_new_reqs}:
            event("dropped and re-added in one step")
        outs = s.update_from_output(so, worker.execute(so))
        for eco in outs.values():
            if eco.scheduler_stats.num_preemptions:
                event("preemption")
            for o in eco.outputs:
                if o.finished:
                    assert o.request_id not in ended
                    ended.add(o.request_id)
        check_invariants(s)

    for op in w["initial"] + w["ops"]:
        if op[0] == "add":
            _, plen, family, max_tokens, prio = op
            plen = min(plen, s.max_model_len)
            rid = f"r{len(added)}"
            prompt = [family * 1000 + i for i in range(plen)]
            t += 1.0
            s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos, t, priority=prio))
            added.append(rid)
        elif op[0] == "abort":
            if added:
                rid = added[op[1] % len(added)]
                for r in s.finish_requests(rid, RequestStatus.FINISHED_ABORTED):
                    ended.add(r.request_id)
                check_invariants(s)
        else:
            for _ in range(op[1]):
                do_step()
    if s.kv_cache_manager.block_pool.get_usage() > 0.99:
        event("cache full")

    # Drain: everything must finish in a bounded number of steps.
    limit = 2000
    while s.has_unfinished_requests() and limit:
        do_step()
        limit -= 1
    assert not s.has_unfinished_requests(), "requests stuck"
    assert ended == set(added)
    s.schedule()  # hands the last finished ids to the worker
    assert s.num_free_blocks == s.num_total_blocks
    assert s.kv_cache_manager.host_pool.get_num_free_blocks() == s.kv_cache_manager.host_pool.num_usable_blocks
    assert s.kv_cache_manager.req_to_blocks == {}
    assert s.reset_prefix_cache() is True


@settings(max_examples=max_examples(60), deadline=None)
@given(
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(1, 16),
)
def test_generated_tokens_do_not_depend_on_budget_or_preemption(prompts, block_size, budget):
    """The same workload run roomy and cramped must produce the same tokens per request."""

    def run(num_blocks: int, budget_: int, mode: str) -> dict[str, list[int]]:
        cfg = make_config(
            num_gpu_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=budget_,
            max_model_len=32,
            preemption_mode=mode,
            num_cpu_blocks=4,
        )
        s = Scheduler(cfg)
        worker = FakeWorker(block_size, 999)
        got: dict[str, list[int]] = {}
        for i, n in enumerate(prompts):
            s.add_request(
                Request(f"r{i}", [i * 100 + j for j in range(n)], SamplingParams(max_tokens=8), 999, float(i))
            )
        for _ in range(3000):
            if not s.has_unfinished_requests():
                break
            so = s.schedule()
            if so.blocks_to_swap_out:
                event(f"{mode}: swap out")
            outs = s.update_from_output(so, worker.execute(so))
            for eco in outs.values():
                if eco.scheduler_stats.num_preemptions:
                    event(f"{mode}: preempted")
                for o in eco.outputs:
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert not s.has_unfinished_requests()
        return got

    roomy = run(200, 512, "recompute")
    tight_blocks = 32 // block_size + 1
    assert run(tight_blocks, budget, "recompute") == roomy
    assert run(tight_blocks, budget, "swap") == roomy
