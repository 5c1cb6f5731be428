"""The benchmark fairness check: a baseline configured unlike the engine must say so in its JSON."""

from __future__ import annotations

import pytest

from vllm_lite.testing.baselines import COMPARED, RunConfig, check_fair, engine_core_threads, fairness_problems


def _engine() -> RunConfig:
    return RunConfig("vllm_lite", "bfloat16", warmup=True, threads=3, batch=64)


def test_a_baseline_configured_like_the_engine_passes() -> None:
    check_fair(_engine(), [RunConfig("hf", "bfloat16", warmup=True, threads=3, batch=[16, 32, 64])])


@pytest.mark.parametrize("field, value", [("dtype", "float32"), ("warmup", False), ("threads", 4)])
def test_an_undeclared_difference_fails_and_names_the_field(field: str, value) -> None:
    baseline = RunConfig("hf", "bfloat16", warmup=True, threads=3)
    setattr(baseline, field, value)
    with pytest.raises(ValueError, match=f"hf: {field}="):
        check_fair(_engine(), [baseline])


@pytest.mark.parametrize("field, value", [("dtype", "float32"), ("warmup", False), ("threads", 4)])
def test_a_declared_difference_passes_and_rides_in_the_json(field: str, value) -> None:
    baseline = RunConfig("hf", "bfloat16", warmup=True, threads=3, declared={field: "the reason"})
    setattr(baseline, field, value)
    check_fair(_engine(), [baseline])
    assert baseline.as_json()["declared"] == {field: "the reason"} and baseline.as_json()[field] == value


def test_declaring_one_field_does_not_excuse_another() -> None:
    baseline = RunConfig("hf", "float32", warmup=False, threads=3, declared={"dtype": "HF has no bf16 kernel"})
    (problem,) = fairness_problems(_engine(), baseline)
    assert "warmup=False" in problem


def test_empty_reason_and_unknown_declared_fields_do_not_count() -> None:
    assert fairness_problems(_engine(), RunConfig("hf", "bfloat16", True, 5, declared={"threads": ""}))
    (problem,) = fairness_problems(_engine(), RunConfig("hf", "bfloat16", True, 3, declared={"batch": "x"}))
    assert "batch" in problem
    assert set(COMPARED) == {"dtype", "warmup", "threads"}


def test_every_problem_of_every_baseline_is_reported_at_once() -> None:
    bad = [RunConfig("a", "float32", True, 3), RunConfig("b", "bfloat16", False, 9)]
    with pytest.raises(ValueError) as e:
        check_fair(_engine(), bad)
    assert str(e.value).count("\n  ") == 3  # a: dtype; b: warmup, threads


def test_engine_core_threads_follow_the_core_policy() -> None:
    import os

    assert engine_core_threads(7) == 7
    assert engine_core_threads(None) == len(os.sched_getaffinity(0))  # every core: the policy on an idle host
