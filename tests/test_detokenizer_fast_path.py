"""The one-id update (the decode step's case) takes an unrolled path: it must agree with the general loop.

Each stream is fed one id at a time (the fast path) and, as reference, all at once or two at a time (the loop),
with and without stop strings, with multi-byte characters split over byte tokens and with an output that ends
inside a character (its ids gave no text while streaming and decode at the finish).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from vllm_lite.client.detokenizer import IncrementalDetokenizer
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.sampling_params import SamplingParams

TEXT = "Hello world, héllo 日本語! The quick brown fox <jumps> over\n  the lazy dog. Ünïcödé ✓ done."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_lite.testing.checkpoints import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def run(tokenizer, ids: list[int], chunk: int, fast: bool, **params) -> tuple:
    req = EngineCoreRequest("r", tokenizer.encode("Say:"), SamplingParams(**params), tokenizer.eos_token_id, 0.0)
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req, use_fast_decode=fast)
    stop, deltas = None, []
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i : i + chunk], False)
        if stop is not None:
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    final = detok.get_next_output_text(finished=True, delta=True)
    return "".join(deltas) + final, stop, detok.output_text, list(detok.output_token_ids)


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "prefix_offsets"])
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"stop": ["fox"]},
        {"stop": ["o w", "日本"], "include_stop_str_in_output": True},
        {"stop": ["語!"]},
        {"stop": ["never there"]},
        {"stop": ["lazy"], "min_tokens": 3},  # min_tokens: the loop, whatever the chunk
    ],
    ids=["plain", "stop", "stop-kept", "stop-multibyte", "no-match", "min-tokens"],
)
def test_one_id_updates_equal_the_general_loop(tokenizer, fast, params):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    one = run(tokenizer, ids, 1, fast, **params)
    assert one[0]  # some text came out
    # Text and stop string as the loop gives them, fed in one update or two ids at a time.
    whole = run(tokenizer, ids, len(ids), fast, **params)
    assert (one[0], one[1]) == (whole[0], whole[1])
    two = run(tokenizer, ids, 2, fast, **params)
    assert (one[0], one[1], one[2]) == (two[0], two[1], two[2])


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "prefix_offsets"])
def test_output_ending_inside_a_character_decodes_its_tail_at_the_finish(tokenizer, fast):
    ids = tokenizer.encode("ab 日本", add_special_tokens=False)
    # Drop the last byte token of "本": the output ends inside that character.
    cut = ids[:-1]
    assert "\ufffd" in tokenizer.decode(cut)
    one = run(tokenizer, cut, 1, fast)
    whole = run(tokenizer, cut, len(cut), fast)
    assert one == whole
    assert one[0] == tokenizer.decode(cut)
