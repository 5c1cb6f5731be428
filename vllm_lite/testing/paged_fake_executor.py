"""A model-free executor with a paged "KV cache" of token ids, for async-scheduling tests of the engine core.

It applies each SchedulerOutput as the model runner must (drop finished ids, run swaps, add new requests in
full, extend cached ones) and keeps, per KV slot, the (position, token) whose K/V a real model would store
there. Its "model" reads a request's whole context back from those slots, so a wrong block table, prefix hit,
swap or position changes the token it samples: `paged_next_token(context)`, a hash of every token in order.

Async scheduling (`execute_model(so, non_block=True)`): the step runs at launch, as the device would run it
in stream order, and the handle's `get_output()` hands back its output later. The input token of a step
whose request's last token is still in flight (a placeholder in the scheduler) comes from this executor's
own record of what it sampled, never from the scheduler: a placeholder at a wrong position breaks the step.
It checks the order the engine core promises: at most `max_in_flight` handles unread, read oldest first,
and no synchronous step while one is unread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from vllm_lite.config import VllmConfig
from vllm_lite.worker.step import ModelRunnerOutput, SchedulerOutput

PAGED_VOCAB = 64


def paged_next_token(context: list[int], vocab: int = PAGED_VOCAB) -> int:
    """The token the fake model samples after `context` (every token, in order, matters)."""
    h = 17
    for t in context:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return (h >> 7) % vocab


def reference_tokens(
    prompt: list[int],
    max_tokens: int,
    max_model_len: int,
    eos: Optional[int],
    ignore_eos: bool = False,
    stop_token_ids: tuple[int, ...] = (),
    min_tokens: int = 0,
    vocab: int = PAGED_VOCAB,
) -> tuple[list[int], str, Optional[int]]:
    """What a request must get: (tokens, "stop" | "length", stop_reason), computed without any engine."""
    ctx = list(prompt)
    out: list[int] = []
    while True:
        tok = paged_next_token(ctx, vocab)
        ctx.append(tok)
        out.append(tok)
        if len(out) >= min_tokens:
            if not ignore_eos and eos is not None and tok == eos:
                return out, "stop", None
            if tok in stop_token_ids:
                return out, "stop", tok
        if len(out) >= max_tokens or len(ctx) >= max_model_len:
            return out, "length", None


@dataclass
class _Row:
    tokens: list[int]  # known to this "device": the request's tokens plus what it sampled itself
    blocks: list[int]
    computed: int


class _Handle:
    """What execute_model(non_block=True) returns: get_output() once, in launch order."""

    def __init__(self, executor: "PagedFakeExecutor", output: ModelRunnerOutput, error: Optional[BaseException]):
        self._executor = executor
        self._output = output
        self._error = error
        self.read = False

    def get_output(self) -> ModelRunnerOutput:
        ex = self._executor
        assert not self.read, "get_output() called twice on one step"
        assert ex.unread and ex.unread[0] is self, "get_output() must read the oldest step in flight first"
        ex.unread.pop(0)
        self.read = True
        if self._error is not None:
            raise self._error
        return self._output


@dataclass
class PagedFakeExecutor:
    """The executor interface (`determine_num_blocks`, `initialize_cache`, `execute_model`, `shutdown`)."""

    vllm_config: VllmConfig
    vocab: int = PAGED_VOCAB
    # The exception a step raises, or None to run it; `late`: an async step raises it from get_output() (it ran).
    fail_when: Optional[Callable[[SchedulerOutput], Optional[BaseException]]] = None
    late: bool = False
    max_in_flight: int = 2
    rows: dict[str, _Row] = field(default_factory=dict)
    kv: dict[int, list] = field(default_factory=dict)
    host: dict[int, list] = field(default_factory=dict)
    unread: list[_Handle] = field(default_factory=list)
    num_steps: int = 0
    num_async_steps: int = 0
    max_unread_seen: int = 0
    shut_down: bool = False

    def determine_num_blocks(self) -> tuple[int, int]:
        cc = self.vllm_config.cache_config
        return (cc.num_gpu_blocks or 64, cc.num_cpu_blocks or 0)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.block_size = self.vllm_config.cache_config.block_size

    def execute_model(self, so: SchedulerOutput, non_block: bool = False):  # noqa: ANN201 -- output or handle
        self.num_steps += 1
        if not non_block:
            assert not self.unread, "a synchronous step ran while an async one was unread"
        else:
            self.num_async_steps += 1
            assert len(self.unread) < self.max_in_flight, "a step launched before the oldest one's output was read"
        error = self.fail_when(so) if self.fail_when is not None else None
        if error is not None and not (non_block and self.late):
            raise error
        output = self._run(so)
        if not non_block:
            return output
        handle = _Handle(self, output, error)
        self.unread.append(handle)
        self.max_unread_seen = max(self.max_unread_seen, len(self.unread))
        return handle

    def shutdown(self) -> None:
        self.shut_down = True

    # ------------------------------------------------------------------ one step, as the device runs it
    def _slot(self, row: _Row, pos: int) -> tuple[int, int]:
        assert pos // self.block_size < len(row.blocks), f"position {pos} past the request's blocks"
        return row.blocks[pos // self.block_size], pos % self.block_size

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in so.finished_req_ids:  # step recovery's probes drop ids the batch may no longer hold
            self.rows.pop(rid, None)
        for d, h in so.blocks_to_swap_out:
            self.host[h] = list(self.kv.get(d, [None] * bs))
        for h, d in so.blocks_to_swap_in:
            self.kv[d] = list(self.host[h])
        for src, dst in so.blocks_to_copy:
            self.kv[dst] = list(self.kv.get(src, [None] * bs))
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.rows, f"{nr.req_id!r} sent as new while in the batch"
            assert 0 not in nr.block_ids, "the null block handed out"
            self.rows[nr.req_id] = _Row(list(nr.prompt_token_ids) + list(nr.output_token_ids), list(nr.block_ids), 0)
            self.rows[nr.req_id].computed = nr.num_computed_tokens
        c = so.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            assert rid in self.rows, f"cached request {rid!r} is not in the batch"
            row = self.rows[rid]
            assert row.computed == computed, f"{rid!r}: computed {row.computed} here, the scheduler says {computed}"
            assert 0 not in new_blocks
            row.blocks += new_blocks
        assert set(so.num_scheduled_tokens) == {nr.req_id for nr in so.scheduled_new_reqs} | set(c.req_ids)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            row = self.rows[rid]
            n = so.num_scheduled_tokens[rid]
            # Every input token must be known here: a placeholder only ever sits right after this device's own
            # last sample, which it appended below when it sampled it.
            assert n >= 1 and row.computed + n <= len(row.tokens), (
                f"{rid!r}: runs positions {row.computed}..{row.computed + n - 1}, {len(row.tokens)} tokens known"
            )
            for pos in range(row.computed, row.computed + n):
                b, o = self._slot(row, pos)
                self.kv.setdefault(b, [None] * bs)[o] = (pos, row.tokens[pos])
            row.computed += n
            if row.computed == len(row.tokens):
                context = []
                for pos in range(row.computed):  # attention reads the whole context from the cache
                    b, o = self._slot(row, pos)
                    entry = self.kv.get(b, [None] * bs)[o]
                    assert entry is not None and entry[0] == pos, f"{rid!r}: slot of position {pos} holds {entry}"
                    context.append(entry[1])
                tok = paged_next_token(context, self.vocab)
                row.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
