"""Offline LLM.generate is deterministic run to run: the core schedules the whole batch in its first step.

Before: the frontend sent requests one by one and the core started stepping on whatever had arrived, so
the first batches (and the bf16 sums in them) changed with timing. The batch now goes as one ADD_BATCH
(in parts when big: the core holds its steps until the last part).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.client import mp_client
from vllm_lite.testing.checkpoints import get_checkpoint

PROMPTS = [("word " * (3 + 5 * i)).strip() for i in range(10)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # bfloat16 as the issue reports it; prefix caching off, so every run computes the same prefill.
    with LLM(
        model=get_checkpoint("llama"),
        dtype="bfloat16",
        max_model_len=128,
        num_threads=1,
        enable_prefix_caching=False,
    ) as engine:
        yield engine


def _generate(llm: LLM) -> tuple[list[list[int]], Any]:
    """Greedy tokens per prompt, and the scheduler stats of the core's first step."""
    client = llm.llm_engine.engine_core
    stats: list[Any] = []
    original = client.get_output

    def recording(*args: Any, **kwargs: Any) -> Any:
        outs = original(*args, **kwargs)
        if outs.scheduler_stats is not None:
            stats.append(outs.scheduler_stats)
        return outs

    client.get_output = recording
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        del client.get_output
    return [list(o.outputs[0].token_ids) for o in outs], stats[0]


def test_first_step_schedules_the_whole_batch_and_tokens_repeat(llm: LLM) -> None:
    runs = [_generate(llm) for _ in range(3)]
    for tokens, first in runs:
        assert (first.num_running_reqs, first.num_waiting_reqs) == (len(PROMPTS), 0)
        assert tokens == runs[0][0]


def test_a_batch_sent_in_parts_is_still_scheduled_whole(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    whole, _ = _generate(llm)
    monkeypatch.setattr(mp_client, "BATCH_MESSAGE_BYTES", 64)  # every request its own part
    messages = llm.llm_engine.engine_core._add_batch_messages(
        [llm.llm_engine.process_request(f"probe-{i}", p, PARAMS)[1] for i, p in enumerate(PROMPTS)]
    )
    assert len(messages) == len(PROMPTS)
    tokens, first = _generate(llm)
    assert (first.num_running_reqs, first.num_waiting_reqs) == (len(PROMPTS), 0)
    assert tokens == whole
