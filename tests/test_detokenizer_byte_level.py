"""The byte-level table detokenizer against the tokenizer's own DecodeStream: the same pieces, id by id.

A byte-level tokenizer's DecodeStream decodes in Rust per token; ByteLevelIncrementalDetokenizer keeps a table
of token bytes and decodes the undecoded tail itself. Random id streams over the whole vocabulary (lone byte
tokens make invalid and split UTF-8 everywhere), special and added tokens, ids the tokenizer does not know,
prompts that end inside a character, and every special-token option must give the same piece at every step.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random

import pytest

from vllm_lite.client.detokenizer import (
    ByteLevelIncrementalDetokenizer,
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    byte_level_table,
)
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_lite.testing.checkpoints import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer(str(tmp_path_factory.mktemp("tok"))))
    # An added (not special) token with a space: outside the byte map, it decodes as its UTF-8 bytes.
    tok.add_tokens(["my added tok", "<tool>"])
    return tok


def pair(tokenizer, prompt_ids: list[int], **params):
    req = EngineCoreRequest("r", prompt_ids, SamplingParams(**params), tokenizer.eos_token_id, 0.0)
    table = IncrementalDetokenizer.from_new_request(tokenizer, req)
    stream = IncrementalDetokenizer.from_new_request(tokenizer, req, use_byte_table=False)
    assert type(table) is ByteLevelIncrementalDetokenizer and type(stream) is FastIncrementalDetokenizer
    return table, stream


OPTIONS = [
    {},
    {"skip_special_tokens": False},
    {"skip_special_tokens": False, "spaces_between_special_tokens": False},
]


@pytest.mark.parametrize("params", OPTIONS, ids=["skip", "keep", "keep-glued"])
@pytest.mark.parametrize("seed", range(4))
def test_random_streams_give_decode_streams_pieces(tokenizer, params, seed):
    rng = random.Random(seed)
    n = len(tokenizer)
    special = list(tokenizer.all_special_ids) + tokenizer.convert_tokens_to_ids(["my added tok", "<tool>"])
    for _ in range(20):
        prompt = [rng.randrange(n) for _ in range(rng.randrange(1, 30))]
        table, stream = pair(tokenizer, prompt, **params)
        for step in range(60):
            r = rng.random()
            tid = rng.choice(special) if r < 0.1 else n + 5 if r < 0.12 else rng.randrange(n)
            assert table.decode_next(tid) == stream.decode_next(tid), (prompt, step, tid)


@pytest.mark.parametrize("params", OPTIONS, ids=["skip", "keep", "keep-glued"])
def test_text_pieces_and_finish_equal_decode_stream(tokenizer, params):
    text = "Hello wörld, 日本語 ☃ <tool> my added tok done.\n  x"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    for prompt in (tokenizer.encode("Say: 日", add_special_tokens=True), tokenizer.encode("☃")[:-1]):
        table, stream = pair(tokenizer, prompt, **params)
        a = [table.decode_next(t) for t in ids]
        b = [stream.decode_next(t) for t in ids]
        assert a == b
        assert "".join(a)
    # Through update/get_next_output_text with a cut inside a character: the finished text matches too.
    cut = tokenizer.encode("ab 日本", add_special_tokens=False)[:-1]
    table, stream = pair(tokenizer, [1], **params)
    for d in (table, stream):
        for t in cut:
            d.update([t], False)
    assert table.get_next_output_text(True, False) == stream.get_next_output_text(True, False)


def test_negative_id_restarts_like_decode_stream(tokenizer):
    ids = tokenizer.encode("日本", add_special_tokens=False)
    table, stream = pair(tokenizer, [1])
    seq = [ids[0], -1, *ids, 7]
    assert [table.decode_next(t) for t in seq] == [stream.decode_next(t) for t in seq]


def test_table_is_shared_per_tokenizer_and_only_for_byte_level(tokenizer):
    from tokenizers import Tokenizer, decoders, models

    backend = tokenizer.backend_tokenizer
    assert byte_level_table(backend) is byte_level_table(backend)
    other = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    other.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    assert byte_level_table(other) is None
