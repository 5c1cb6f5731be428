"""Structured outputs are valid on a random-weight model, which emits garbage unless the constraint holds.

Every JSON schema, regex, choice list and grammar of vllm_lite/testing/json_schemas.py runs in ONE batched
`LLM.generate` per backend (greedy, float32), and every output must satisfy
its constraint: jsonschema on `json.loads`, `re.fullmatch`, set membership, the grammar's own parser. Every
request must also end by the grammar closing (finish_reason "stop"), never by running out of max_tokens: an
output cut short would be invalid for a reason that is not the engine's.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.json_schemas import JSON_SCHEMAS, ConstraintCase, cases_for, check_output

# Far above what any case needs (the longest schema closes in well under 100 tokens on a random walk).
MAX_TOKENS = 192

PROMPTS = [
    "Return the answer as JSON:",
    "The for statement",
    "Exceptions are raised by",
    "x",
    "The while statement is used for repeated execution as long as an expression is true.",
]


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def engine(request) -> Iterator[tuple[str, LLM]]:
    """(backend, LLM): one engine per backend for the module (the tiny checkpoint starts in a few seconds)."""
    engine = LLM(
        model=get_checkpoint("llama"),
        dtype="float32",
        multiprocess=False,  # the wire is test_structured_output_engine's; this file checks the outputs
        max_model_len=512,
        kv_cache_memory_bytes=16 << 20,
        structured_outputs_config={"backend": request.param},
    )
    yield request.param, engine
    engine.shutdown()


def _params(case: ConstraintCase) -> SamplingParams:
    # JSON without optional whitespace: with it, a random model can pad with blanks until max_tokens (the
    # grammar allows any amount), which says nothing about the engine.
    compact = {"disable_any_whitespace": True} if case.kind == "json" else {}
    so = StructuredOutputsParams(**{case.kind: case.spec}, **compact)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so)


def _generate_all(llm: LLM, cases: list[ConstraintCase]) -> list:
    """All cases in one batch, each with a different prompt (so the random model's choices differ)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    return llm.generate(prompts, [_params(c) for c in cases], use_tqdm=False)


def test_every_constraint_output_is_valid_in_one_batch(engine: tuple[str, LLM]) -> None:
    """≥ 20 schemas plus regexes, choices and a grammar: 100% valid, each closed by its grammar."""
    backend, llm = engine
    cases = cases_for(backend)  # the grammar in the format the backend takes: EBNF for xgrammar, Lark for guidance
    assert len([c for c in cases if c.kind == "json"]) >= 20
    outs = _generate_all(llm, cases)
    problems = []
    for case, out in zip(cases, outs):
        completion = out.outputs[0]
        if completion.finish_reason != "stop":
            problems.append(f"{case.name}: finished by {completion.finish_reason}: {completion.text!r}")
            continue
        try:
            check_output(case, completion.text)
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


def test_free_text_from_the_same_model_is_not_valid_json(engine: tuple[str, LLM]) -> None:
    """The control: unconstrained, this model's output parses as none of the schemas (so the constraint did it)."""
    outs = engine[1].generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for out in outs:
        for case in JSON_SCHEMAS:
            with pytest.raises(AssertionError):
                check_output(case, out.outputs[0].text)
