"""An output that ends inside a multi-byte UTF-8 character: held back while streaming, HF's decode at the end.

Byte-level BPE splits characters that are rare in the tokenizer's training text into one token per
byte, so `naïve ☃` cut one or two tokens early ends mid-character. While the request streams, the
text must never show the replacement character for a character that a later token may complete;
once it finishes, no later token can, and the text is what the tokenizer's own `decode` of all the
output ids gives (the oracle), replacement character included. The engine test forces the premise by
`allowed_token_ids`: the only token it may sample is the lead byte of a three-byte character.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.client.output_processor import OutputProcessor
from vllm_lite.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm_lite.sampling_params import RequestOutputKind
from vllm_lite.testing.checkpoints import get_checkpoint

REPLACEMENT = "\ufffd"
TEXT = "naïve ☃ 日本"


@pytest.fixture(scope="module")
def path() -> str:
    return get_checkpoint("llama")


@pytest.fixture(scope="module")
def tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def cuts_inside_a_character(tokenizer: Any) -> list[list[int]]:
    """Every prefix of TEXT's ids whose decode ends in an incomplete character (built, then checked)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cuts = [ids[:n] for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT)]
    assert len(cuts) >= 4, f"TEXT no longer splits characters into byte tokens: {ids}"
    return cuts


def stream(tokenizer: Any, ids: list[int], kind: RequestOutputKind, fast: bool) -> tuple[list[str], str]:
    """Feed `ids` one per core output as the core sends them; the text after each step, and the final text."""
    proc = OutputProcessor(tokenizer)
    request = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=tokenizer.encode("Say:", add_special_tokens=False),
        sampling_params=SamplingParams(max_tokens=len(ids), output_kind=kind),
        eos_token_id=tokenizer.eos_token_id,
        arrival_time=0.0,
    )
    proc.add_request(request, "Say:")
    if not fast:
        state = proc.request_states["r"]
        from vllm_lite.client.detokenizer import IncrementalDetokenizer

        state.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request, use_fast_decode=False)
    texts: list[str] = []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineCoreOutput("r", [tid], finish_reason=FinishReason.LENGTH if last else None)
        for ro in proc.process_outputs([out]).request_outputs:
            piece = ro.outputs[0].text
            texts.append(texts[-1] + piece if kind == RequestOutputKind.DELTA and texts else piece)
    return texts[:-1], texts[-1]


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA], ids=["cumulative", "delta"])
@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "prefix_offsets"])
def test_streaming_holds_back_the_partial_character_and_the_end_is_hf_decode(tokenizer, kind, fast) -> None:
    for ids in cuts_inside_a_character(tokenizer):
        streamed, final = stream(tokenizer, ids, kind, fast)
        want = tokenizer.decode(ids)
        assert final == want, f"{ids}: final text {final!r}, HF decode {want!r}"
        for text in streamed:
            assert REPLACEMENT not in text, f"{ids}: streamed {text!r} shows a character not yet complete"
            assert want.startswith(text), f"{ids}: streamed {text!r} is not a prefix of {want!r}"
        # After each step: HF's decode of the ids so far, less the character they have not completed yet.
        for n, text in enumerate(streamed, start=1):
            assert text == tokenizer.decode(ids[:n]).removesuffix(REPLACEMENT), f"{ids[:n]}: streamed {text!r}"


def test_engine_output_ending_on_a_lead_byte_is_hf_decode(path: str, tokenizer) -> None:
    lead = tokenizer.encode("☃", add_special_tokens=False)[0]
    assert tokenizer.decode([lead]) == REPLACEMENT, "the premise: this token is a lead byte alone"

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(
            max_tokens=3, allowed_token_ids=[lead], ignore_eos=True, temperature=0.0, output_kind=kind
        )

    with LLM(model=path, dtype="float32", multiprocess=False, max_model_len=64) as llm:
        engine = llm.llm_engine
        engine.add_request("d", "naïve", params(RequestOutputKind.DELTA))
        streamed, final = "", None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = streamed + out.outputs[0].text
                else:
                    streamed += out.outputs[0].text
        (whole,) = llm.generate("naïve", params(RequestOutputKind.CUMULATIVE), use_tqdm=False)
    ids = list(whole.outputs[0].token_ids)
    assert ids == [lead] * 3
    assert whole.outputs[0].text == tokenizer.decode(ids) == final
    assert not streamed.endswith(REPLACEMENT), f"streamed {streamed!r} ends in a character not yet complete"
