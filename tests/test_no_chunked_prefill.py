"""vLLM's enable_chunked_prefill=False for generative models: a prompt (its part past a prefix-cache hit) runs
whole in one step or waits, a running request is never cut by the budget either, decodes keep running beside;
preemption, swapping and prefix caching hold; the greedy tokens of a real engine do not change."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.sched.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.testing.hypothesis_profiles import max_examples
from vllm_lite.testing.scheduler_config import make_config
from vllm_lite.testing.scheduler_driver import fake_runner_output, make_request
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput


def _config(chunked: bool = False, async_scheduling: bool = False, **kw):
    cfg = make_config(**kw)
    cfg.scheduler_config.enable_chunked_prefill = chunked
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


def _known(sched: Scheduler) -> dict[str, int]:
    """Each request's known tokens (with those still in flight), taken before a schedule()."""
    return {rid: r.num_tokens + r.num_output_placeholders for rid, r in sched.requests.items()}


def _assert_whole(so: SchedulerOutput, known: dict[str, int]) -> None:
    """Every scheduled request runs all its known tokens not yet computed: nothing is a chunk."""
    new = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    cached = dict(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
    for rid, n in so.num_scheduled_tokens.items():
        start = new[rid] if rid in new else cached[rid]
        assert start + n == known[rid], f"{rid}: {n} tokens from {start} of {known[rid]}: a chunk"


def _step(sched: Scheduler, check: bool = True) -> SchedulerOutput:
    """schedule (checked: no chunk) -> fake forward -> update_from_output."""
    known = _known(sched)
    so = sched.schedule()
    if check:
        _assert_whole(so, known)
    sched.update_from_output(so, fake_runner_output(sched, so))
    return so


def test_a_prompt_that_does_not_fit_waits_while_decodes_run():
    s = Scheduler(_config(max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=65, block_size=4))
    for i in range(5):
        s.add_request(make_request(f"d{i}", 4, start=100 * i, max_tokens=4))
    so = _step(s)
    assert so.total_num_scheduled_tokens == 20
    s.add_request(make_request("big", 62, start=5000))
    s.add_request(make_request("small", 3, start=7000))  # behind it: FCFS, it waits too (as vLLM V1)
    for _ in range(3):  # 5 decodes leave 59 tokens: not enough for 62
        so = _step(s)
        assert set(so.num_scheduled_tokens) == {f"d{i}" for i in range(5)}
        assert all(n == 1 for n in so.num_scheduled_tokens.values())
    assert s.get_request("big").status == RequestStatus.WAITING
    so = _step(s)  # the decodes finished (max_tokens 4): the whole prompt runs in one step, then the next
    assert so.num_scheduled_tokens == {"big": 62}
    so = _step(s)
    assert so.num_scheduled_tokens == {"big": 1, "small": 3}


def test_chunked_prefill_on_cuts_the_same_prompt():
    """The same workload with chunked prefill on (the default): the long prompt is split (what off forbids)."""
    s = Scheduler(_config(chunked=True, max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=65, block_size=4))
    for i in range(5):
        s.add_request(make_request(f"d{i}", 4, start=100 * i, max_tokens=4))
    _step(s, check=False)
    s.add_request(make_request("big", 62, start=5000))
    so = _step(s, check=False)
    assert so.num_scheduled_tokens["big"] == 59


def test_prefix_cache_hit_lets_the_rest_fit():
    """Only the tokens past the cached prefix must fit the step: 48 cached of 64 leaves 16 to run beside decodes."""
    s = Scheduler(_config(max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=65, block_size=4))
    prefix = list(range(3000, 3048))
    s.add_request(make_request("first", prefix, max_tokens=1))
    so = _step(s)
    assert so.num_scheduled_tokens == {"first": 48}
    for i in range(4):
        s.add_request(make_request(f"d{i}", 4, start=100 * i, max_tokens=20))
    _step(s)
    s.add_request(make_request("hit", prefix + list(range(9000, 9016))))  # 64 tokens: more than 60 left
    so = _step(s)
    new = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
    assert new == {"hit": 48} and so.num_scheduled_tokens["hit"] == 16
    # Without the hit the same 64 tokens wait.
    s.add_request(make_request("miss", list(range(20000, 20064))))
    so = _step(s)
    assert "miss" not in so.num_scheduled_tokens and s.get_request("miss").status == RequestStatus.WAITING


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_resume_whole(mode):
    """A cache too small for every request: preemptions (recompute or swap) and resumes never split a request,
    every request finishes and every block comes back."""
    s = Scheduler(
        _config(
            max_num_batched_tokens=32,
            max_model_len=32,
            num_gpu_blocks=9,
            block_size=4,
            preemption_mode=mode,
            num_cpu_blocks=16 if mode == "swap" else 0,
        )
    )
    for i in range(4):
        s.add_request(make_request(f"r{i}", 6 + 3 * i, start=100 * i, max_tokens=12))
    preemptions = 0
    for _ in range(300):
        if not s.has_unfinished_requests():
            break
        known = _known(s)
        so = s.schedule()
        _assert_whole(so, known)
        outs = s.update_from_output(so, fake_runner_output(s, so))
        preemptions += sum(eco.scheduler_stats.num_preemptions for eco in outs.values() if eco.scheduler_stats)
    assert not s.has_unfinished_requests()
    assert preemptions > 0
    s.schedule()
    assert s.num_free_blocks == s.num_total_blocks


def test_a_rewound_running_prompt_is_not_cut():
    """Async scheduling: both steps in flight are taken back (unschedule_last); the prompt admitted whole in the
    second must not then be cut by the first's request, which needs its 4 tokens again."""

    def run(chunked: bool) -> list[dict[str, int]]:
        s = Scheduler(
            _config(chunked, True, max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=65, block_size=4)
        )
        s.add_request(make_request("a", 4, max_tokens=1))
        so1 = s.schedule()
        s.add_request(make_request("big", 64, start=5000))
        so2 = s.schedule()  # a's only token is in flight: it runs nothing; big gets the whole budget
        assert so2.num_scheduled_tokens == {"big": 64}
        s.unschedule_last(so2)
        s.unschedule_last(so1)
        got = []
        for _ in range(4):
            so = _step(s, check=not chunked)
            got.append(dict(so.num_scheduled_tokens))
        return got

    assert run(chunked=False)[:2] == [{"a": 4}, {"big": 64}]
    assert run(chunked=True)[0] == {"a": 4, "big": 60}


def test_a_budget_below_max_model_len_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(_config(max_num_batched_tokens=63, max_model_len=64))
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(_config(max_num_batched_tokens=64, max_model_len=64, long_prefill_token_threshold=8))
    # The cache caps max_model_len (9 blocks of 4, one the null block): 32 tokens, so a 32-token budget is enough.
    Scheduler(_config(max_num_batched_tokens=32, max_model_len=64, num_gpu_blocks=9, block_size=4))


class _Worker:
    """Holds each request's tokens and computed count as a worker would, and checks every step against them."""

    def __init__(self, eos: int) -> None:
        self.eos = eos
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            del self.tokens[rid], self.computed[rid]
        for nr in so.scheduled_new_reqs:
            self.tokens[nr.req_id] = nr.prompt_token_ids + nr.output_token_ids
            self.computed[nr.req_id] = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, computed in zip(c.req_ids, c.num_computed_tokens):
            assert self.computed[rid] == computed
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            toks = self.tokens[rid]
            n = so.num_scheduled_tokens[rid]
            assert self.computed[rid] + n == len(toks), f"{rid}: {n} of {len(toks) - self.computed[rid]}: a chunk"
            if n > 1:
                event("prompt" if self.computed[rid] == 0 else "prompt after a prefix hit or resume")
            self.computed[rid] += n
            tok = (sum(toks[-3:]) * 31 + len(toks)) % 50
            tok = self.eos if tok == 0 else tok
            toks.append(tok)
            sampled.append([tok])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


@settings(max_examples=max_examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_model_len=st.integers(4, 40),
    extra_budget=st.integers(0, 30),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    mode=st.sampled_from(["recompute", "swap"]),
    cpu_blocks=st.integers(0, 16),
    prefix=st.booleans(),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 3), st.integers(1, 20)),
            st.tuples(st.just("abort"), st.integers(0, 30)),
            st.tuples(st.just("step"), st.integers(1, 4)),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_random_workloads_never_chunk_and_leak_no_block(
    max_model_len, extra_budget, block_size, num_blocks, max_num_seqs, mode, cpu_blocks, prefix, ops
):
    # The cache may hold fewer tokens than max_model_len: the scheduler caps it, and the budget need only hold that.
    capacity = num_blocks * block_size
    budget = min(max_model_len, capacity) + extra_budget
    s = Scheduler(
        _config(
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            num_gpu_blocks=num_blocks + 1,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            preemption_mode=mode,
            num_cpu_blocks=cpu_blocks,
            enable_prefix_caching=prefix,
        )
    )
    eos = 999
    worker = _Worker(eos)
    added: list[str] = []

    def do_step() -> None:
        known = _known(s)
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= budget
        _assert_whole(so, known)
        s.update_from_output(so, worker.execute(so))

    for op in ops:
        if op[0] == "add":
            _, plen, family, max_tokens = op
            rid = f"r{len(added)}"
            prompt = [family * 1000 + i for i in range(min(plen, s.max_model_len))]
            s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos, float(len(added))))
            added.append(rid)
        elif op[0] == "abort":
            if added:
                s.finish_requests(added[op[1] % len(added)], RequestStatus.FINISHED_ABORTED)
        else:
            for _ in range(op[1]):
                do_step()
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        do_step()
    assert not s.has_unfinished_requests(), "requests stuck"
    s.schedule()  # hands the last finished ids to the worker
    kv = s.kv_cache_manager
    assert s.num_free_blocks == s.num_total_blocks and kv.req_to_blocks == {}
    assert kv.host_pool.get_num_free_blocks() == kv.host_pool.num_usable_blocks
    assert s.reset_prefix_cache() is True


def test_llm_without_chunked_prefill_gives_the_default_greedy_tokens():
    """A real engine: off (with a cache small enough to preempt; alone and with n-gram speculative decoding) and
    the default (a small budget, so prompts are chunked) give the same greedy tokens, constrained ones too."""
    from vllm_lite import LLM
    from vllm_lite.sampling_params import StructuredOutputsParams
    from vllm_lite.testing.checkpoints import get_checkpoint

    lengths = [5, 40, 61, 17, 33]
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(n)]} for i, n in enumerate(lengths)]
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    choice = SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    common = dict(model=get_checkpoint("llama"), dtype="float32", multiprocess=False, max_model_len=96)
    off = dict(enable_chunked_prefill=False, max_num_batched_tokens=96, num_gpu_blocks_override=12, block_size=16)
    results = []
    for kwargs in (
        dict(max_num_batched_tokens=16),
        off,
        dict(off, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
    ):
        with LLM(**common, **kwargs) as llm:
            config = llm.llm_engine.vllm_config.scheduler_config
            assert config.enable_chunked_prefill is ("enable_chunked_prefill" not in kwargs)
            outs = llm.generate(prompts + prompts[:2], [sp] * len(prompts) + [choice] * 2, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
            tok = llm.get_tokenizer()
            for o in outs[len(prompts) :]:  # (its text starts with the byte tokens the prompt left undecoded)
                assert tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) in ("yes", "no")
    assert results[0] == results[1] == results[2]
    assert all(len(t) == 8 for t in results[0][: len(prompts)])
