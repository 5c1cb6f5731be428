"""Structured outputs below the engine: both backends' matchers, the manager's cache, the config and flags,
and the sampler's bitmask against a naive reference. No model runs here."""

from __future__ import annotations

import argparse
import json
import threading
from typing import Any

import numpy as np
import pytest
import torch

from vllm_lite.config import StructuredOutputsConfig
from vllm_lite.engine_args import EngineArgs
from vllm_lite.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_lite.structured_output.backend_guidance import GuidanceBackend
from vllm_lite.structured_output.backend_types import GrammarCompileError, StructuredOutputBackend
from vllm_lite.structured_output.backend_xgrammar import XgrammarBackend
from vllm_lite.structured_output.manager import StructuredOutputManager, bitmask_width, load_tokenizer
from vllm_lite.structured_output.spec import GrammarSpec, spec_from_params
from vllm_lite.testing.checkpoints import get_checkpoint
from vllm_lite.testing.waiting import wait_until
from vllm_lite.worker.sampler import Sampler, apply_grammar_bitmask, expand_bitmask
from vllm_lite.worker.sampling_state import SamplingState

BACKENDS = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}
PADDED_VOCAB = 2048 + 64  # the tiny tokenizer has 2000 tokens: ids 2000.. exist only in the logits


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(get_checkpoint("llama"))


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tokenizer: Any) -> StructuredOutputBackend:
    return BACKENDS[request.param](tokenizer, PADDED_VOCAB, [tokenizer.eos_token_id])


def spec(**kw: Any) -> GrammarSpec:
    return spec_from_params(StructuredOutputsParams(**kw))


def mask_of(matcher: Any) -> torch.Tensor:
    bitmask = torch.zeros((1, bitmask_width(PADDED_VOCAB)), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return expand_bitmask(bitmask, PADDED_VOCAB)[0]


def test_matcher_rollback_restores_the_earlier_state(backend: StructuredOutputBackend, tokenizer: Any) -> None:
    compiled = backend.compile(spec(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    tokens = tokenizer.encode('{"a": 1234', add_special_tokens=False)
    assert len(tokens) >= 4
    m = backend.new_matcher(compiled)
    assert m.accept_tokens(tokens)
    m.rollback(3)
    assert m.num_accepted_tokens == len(tokens) - 3
    ref = backend.new_matcher(compiled)
    assert ref.accept_tokens(tokens[:-3])
    assert torch.equal(mask_of(m), mask_of(ref))
    assert m.accept_tokens(tokens[-3:])  # and it goes on from there
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(len(tokens) + 1)


def test_matcher_terminates_on_eos_and_resets(backend: StructuredOutputBackend, tokenizer: Any) -> None:
    compiled = backend.compile(spec(choice=["yes", "no"]))
    m = backend.new_matcher(compiled)
    fresh = mask_of(m)
    assert not m.accept_tokens(tokenizer.encode("maybe", add_special_tokens=False)[:1])
    assert m.accept_tokens(tokenizer.encode("yes", add_special_tokens=False))
    allowed = mask_of(m).nonzero().flatten().tolist()
    assert allowed == [tokenizer.eos_token_id]  # complete: only EOS may follow
    assert m.accept_tokens([tokenizer.eos_token_id]) and m.is_terminated()
    m.reset()
    assert not m.is_terminated() and m.num_accepted_tokens == 0
    assert torch.equal(mask_of(m), fresh)


def test_batched_fill_equals_one_row_at_a_time(backend: StructuredOutputBackend, tokenizer: Any) -> None:
    compiled = backend.compile(spec(json={"type": "object", "properties": {"name": {"type": "string"}}}))
    prefixes = ["", "{", '{"name": "a', '{"name": "ab"', '{"name": "ab"}']
    matchers = [backend.new_matcher(compiled) for _ in prefixes]
    for m, text in zip(matchers, prefixes):
        assert m.accept_tokens(tokenizer.encode(text, add_special_tokens=False))
    batched = torch.zeros((len(matchers) + 1, bitmask_width(PADDED_VOCAB)), dtype=torch.int32)
    type(matchers[0]).fill_bitmask_batch([(m, i + 1) for i, m in enumerate(matchers)], batched)
    assert not batched[0].any()  # rows not named are left alone
    for i, m in enumerate(matchers):
        assert torch.equal(expand_bitmask(batched[i + 1 : i + 2], PADDED_VOCAB)[0], mask_of(m)), prefixes[i]


def test_ids_past_the_tokenizer_are_always_masked(backend: StructuredOutputBackend) -> None:
    m = backend.new_matcher(backend.compile(spec(json_object=True)))
    allowed = mask_of(m)
    assert allowed[:2000].any()
    assert not allowed[2000:].any()


@pytest.mark.parametrize(
    "kw, fragment",
    [({"regex": "[a-"}, "["), ({"json": '{"type": "nope"}'}, "nope"), ({"choice": ["a"]}, None)],
)
def test_compile_errors_carry_the_compilers_message(backend: StructuredOutputBackend, kw: dict, fragment: Any) -> None:
    if fragment is None:  # a valid constraint compiles
        backend.compile(spec(**kw))
        return
    with pytest.raises(GrammarCompileError, match=None) as info:
        backend.compile(spec(**kw))
    assert fragment in str(info.value)


def test_xgrammar_refuses_lark_and_guidance_takes_it(tokenizer: Any) -> None:
    lark = spec(grammar='start: "a" | "b"')
    with pytest.raises(GrammarCompileError, match="EBNF"):
        XgrammarBackend(tokenizer, PADDED_VOCAB, [2]).compile(lark)
    GuidanceBackend(tokenizer, PADDED_VOCAB, [2]).compile(lark)


def test_vllms_structural_tag_form_constrains_after_its_trigger(tokenizer: Any) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<f>", "schema": {"properties": {"a": {"type": "integer"}}, "required": ["a"]}, "end": "</f>"}
        ],
        "triggers": ["<f>"],
    }
    backend = XgrammarBackend(tokenizer, PADDED_VOCAB, [2])
    m = backend.new_matcher(backend.compile(spec(structural_tag=json.dumps(tag))))
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert m.accept_tokens(enc("free text <f>"))
    assert not m.accept_tokens(enc("hello"))  # inside the tag: JSON only
    assert m.accept_tokens(enc('{"a": 12}</f>')) and m.accept_tokens(enc(" free again"))


# ---------------------------------------------------------------------------- the manager
@pytest.fixture(scope="module")
def vllm_config() -> Any:
    return EngineArgs(model=get_checkpoint("llama"), device="cpu").create_engine_config()


def prepared(manager: StructuredOutputManager, params: StructuredOutputsParams) -> Any:
    sor = manager.grammar_init(params)
    wait_until(sor.is_ready, timeout_s=120, what="grammar compiled")
    return sor


def test_manager_compiles_each_spec_once_and_gives_each_request_its_own_matcher(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = StructuredOutputManager(vllm_config)
    calls: list[GrammarSpec] = []
    gate = threading.Event()
    original = manager._compile

    def counting(s: GrammarSpec) -> Any:
        calls.append(s)
        gate.wait(60)  # hold the first compile so the identical ones arrive while it runs
        return original(s)

    monkeypatch.setattr(manager, "_compile", counting)
    try:
        params = StructuredOutputsParams(regex="[0-9]{3}")
        sors = [manager.grammar_init(params) for _ in range(4)]
        gate.set()
        for sor in sors:
            wait_until(sor.is_ready, timeout_s=120, what="grammar compiled")
        assert len(calls) == 1
        assert all(s.error is None for s in sors)
        assert len({id(s.matcher) for s in sors}) == 4
        prepared(manager, StructuredOutputsParams(regex="[0-9]{3}"))  # cached: still one compile
        prepared(manager, StructuredOutputsParams(regex="[0-9]{4}"))
        assert len(calls) == 2
    finally:
        manager.shutdown()


@pytest.mark.parametrize("backend, expect_error", [("auto", False), ("xgrammar", True), ("guidance", False)])
def test_manager_backend_choice_and_auto_fallback(vllm_config: Any, backend: str, expect_error: bool) -> None:
    import dataclasses

    config = dataclasses.replace(vllm_config, structured_outputs_config=StructuredOutputsConfig(backend=backend))
    manager = StructuredOutputManager(config)
    try:
        sor = prepared(manager, StructuredOutputsParams(grammar='start: "a" | "b"'))  # Lark: guidance only
        assert (sor.error is not None) == expect_error, sor.error
        if expect_error:
            assert sor.error.startswith("invalid structured_outputs.grammar: ") and "EBNF" in sor.error
        bad = prepared(manager, StructuredOutputsParams(regex="[a-"))
        assert bad.error is not None and "invalid structured_outputs.regex" in bad.error
        assert prepared(manager, StructuredOutputsParams(json="{not json")).error.startswith(
            "structured_outputs.json is not valid JSON"
        )
    finally:
        manager.shutdown()


def test_manager_bitmask_rows_follow_the_matchers(vllm_config: Any, tokenizer: Any) -> None:
    manager = StructuredOutputManager(vllm_config)
    try:
        a = prepared(manager, StructuredOutputsParams(choice=["yes", "no"])).matcher
        b = prepared(manager, StructuredOutputsParams(regex="[0-9]+")).matcher
        bitmask = manager.fill_bitmask([a, b])
        assert bitmask.dtype == np.int32 and bitmask.shape == (2, bitmask_width(vllm_config.model_config.vocab_size))
        allowed = expand_bitmask(torch.from_numpy(bitmask), vllm_config.model_config.vocab_size)
        yes, digit = tokenizer.encode("yes", add_special_tokens=False)[0], tokenizer.encode("7")[-1]
        assert allowed[0, yes] and not allowed[0, digit]
        assert allowed[1, digit] and not allowed[1, yes]
    finally:
        manager.shutdown()


# ---------------------------------------------------------------------------- config and flags
def test_unknown_backend_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="structured_outputs_config.backend"):
        StructuredOutputsConfig(backend="outlines")
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        StructuredOutputsConfig.from_value({"bogus": 1})
    args = EngineArgs(model=get_checkpoint("llama"), device="cpu", structured_outputs_config={"backend": "nope"})
    with pytest.raises(ValueError, match="structured_outputs_config.backend"):
        args.create_engine_config()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--structured-outputs-config", '{"backend": "guidance"}'], StructuredOutputsConfig(backend="guidance")),
        (["--structured-outputs-config.backend", "xgrammar"], StructuredOutputsConfig(backend="xgrammar")),
        (
            ["--structured-outputs-backend", "guidance", "--structured-outputs-config.disable-any-whitespace"],
            StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True),
        ),
        (
            ["--structured-outputs-config", '{"disable_fallback": true}', "--structured-outputs-config.backend=auto"],
            StructuredOutputsConfig(disable_fallback=True),
        ),
        ([], None),
    ],
)
def test_cli_flags_as_vllm_names_them(argv: list[str], expected: Any) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))
    assert args.structured_outputs_config == expected


def test_cli_rejects_an_unknown_backend(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--structured-outputs-config", '{"backend": "outlines"}'])
    assert "structured_outputs_config.backend" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the sampler's mask
def random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.rand((rows, bitmask_width(vocab) * 32), generator=gen) < 0.3
    bits[0] = True  # an unconstrained row: all ones
    bits[:, 0] = True  # never an empty row
    weights = 1 << torch.arange(32, dtype=torch.int64)
    packed = (bits.view(rows, -1, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def naive_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def test_bitmask_application_matches_a_naive_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's spare bits are ignored
    logits = torch.randn((5, vocab), generator=gen)
    bitmask = random_bitmask(5, vocab, gen)
    assert torch.equal(apply_grammar_bitmask(logits.clone(), bitmask), naive_mask(logits, bitmask))
    wider = torch.randn((5, 32 * bitmask.shape[1] + 3), generator=gen)  # logits past the bitmask: forbidden
    masked = apply_grammar_bitmask(wider.clone(), bitmask)
    assert torch.isinf(masked[:, -3:]).all()
    assert torch.equal(masked[:, :vocab], naive_mask(wider[:, :vocab], bitmask))


def _sampler_inputs(params: list[SamplingParams], vocab: int) -> Any:
    state = SamplingState(len(params), vocab, 64, torch.device("cpu"))
    for row, p in enumerate(params):
        state.add_request(row, p, [1, 2, 3], [], None)
    return state.make_metadata(np.arange(len(params), dtype=np.int64))


def test_greedy_picks_the_best_allowed_token_and_logprobs_stay_raw() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 200
    logits = torch.randn((4, vocab), generator=gen)
    bitmask = random_bitmask(4, vocab, gen)
    md = _sampler_inputs([SamplingParams(temperature=0.0, logprobs=2)] * 4, vocab)
    out = Sampler()(logits, md, bitmask)
    expected = naive_mask(logits, bitmask).argmax(-1)
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.sampled_token_ids[0] == logits[0].argmax()  # the all-ones row is untouched
    raw = torch.log_softmax(logits, -1).gather(1, expected.unsqueeze(1)).squeeze(1)
    assert out.logprobs_tensors is not None
    torch.testing.assert_close(out.logprobs_tensors.logprobs[:, 0], raw)


def test_random_sampling_never_picks_a_masked_token() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab, rows = 96, 64
    logits = torch.randn((1, vocab), generator=gen).repeat(rows, 1) * 3
    bitmask = random_bitmask(2, vocab, gen)[1:].repeat(rows, 1)  # the same sparse mask on every row
    allowed = expand_bitmask(bitmask, vocab)[0]
    params = [SamplingParams(temperature=1.5, top_p=0.95), SamplingParams(temperature=1.0, top_k=50)] * (rows // 2)
    md = _sampler_inputs(params, vocab)
    sampled = torch.cat([Sampler()(logits, md, bitmask).sampled_token_ids for _ in range(5)])
    assert allowed[sampled].all()
    assert len(set(sampled.tolist())) > 1  # it still samples among the allowed ones


# ---------------------------------------------------------------- schemas xgrammar would not enforce
MULTIPLE_OF = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]}
BOUNDED_STRING = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}


@pytest.mark.parametrize(
    "schema, expected",
    [
        (MULTIPLE_OF, ["multipleOf"]),
        (BOUNDED_STRING, ["maxLength"]),
        ({"$defs": {"t": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/t"}, ["uniqueItems"]),
        ({"type": "array", "uniqueItems": False, "items": {"enum": [{"maxLength": 1}]}}, []),  # enum values are data
        ({"type": "object", "properties": {"maxLength": {"type": "integer"}}}, []),  # a property named like a keyword
    ],
)
def test_schema_features_that_xgrammar_would_not_enforce_are_found(schema: Any, expected: list[str]) -> None:
    from vllm_lite.structured_output.schema_features import xgrammar_unsupported_features

    assert xgrammar_unsupported_features(schema) == expected


@pytest.mark.parametrize("schema", [MULTIPLE_OF, BOUNDED_STRING])
def test_auto_sends_unenforced_schemas_to_guidance_and_xgrammar_refuses_them(vllm_config: Any, schema: Any) -> None:
    """xgrammar 0.2 compiles multipleOf with a warning and lets control characters into bounded strings."""
    import dataclasses

    from vllm_lite.structured_output.backend_guidance import GuidanceMatcher

    for name in ("auto", "xgrammar"):
        config = dataclasses.replace(vllm_config, structured_outputs_config=StructuredOutputsConfig(backend=name))
        manager = StructuredOutputManager(config)
        try:
            sor = prepared(manager, StructuredOutputsParams(json=schema))
            if name == "auto":
                assert sor.error is None and isinstance(sor.matcher, GuidanceMatcher)
            else:
                assert sor.error is not None and "xgrammar does not enforce" in sor.error
        finally:
            manager.shutdown()


def test_guidance_forbids_control_characters_and_non_multiples(tokenizer: Any) -> None:
    guidance = GuidanceBackend(tokenizer, PADDED_VOCAB, [tokenizer.eos_token_id])
    m = guidance.new_matcher(guidance.compile(spec(json=BOUNDED_STRING, disable_any_whitespace=True)))
    assert m.accept_tokens(tokenizer.encode('{"s":"', add_special_tokens=False))
    control = [t for t in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))]
    assert control and not mask_of(m)[control].any()
    m = guidance.new_matcher(guidance.compile(spec(json=MULTIPLE_OF, disable_any_whitespace=True)))
    assert not m.accept_tokens(tokenizer.encode('{"n":7}', add_special_tokens=False))


def test_object_properties_keep_the_schema_order(backend: StructuredOutputBackend, tokenizer: Any) -> None:
    """As vLLM and OpenAI: keys are generated in the order the schema lists them, not sorted."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    compiled = backend.compile(spec(json=schema, disable_any_whitespace=True))

    def accepted(text: str) -> bool:  # either backend's separators: xgrammar writes ", " and ": "
        return any(
            backend.new_matcher(compiled).accept_tokens(tokenizer.encode(t, add_special_tokens=False))
            for t in (text, text.replace(",", ", ").replace(":", ": "))
        )

    assert accepted('{"zeta":true,"alpha":false}')
    assert not accepted('{"alpha":false,"zeta":true}')
