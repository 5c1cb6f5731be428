"""Incremental detokenization and stop strings, fed by hand-made token id streams."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from vllm_lite.client.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    find_stop_string,
    stop_prefix_holdback,
)
from vllm_lite.core.messages import EngineCoreRequest
from vllm_lite.sampling_params import SamplingParams

torch.set_num_threads(1)

TEXT = "Hello world, héllo 日本語! The quick brown fox <jumps> over\n  the lazy dog. Ünïcödé ✓ done."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_lite.testing.checkpoints import build_tokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def make_request(tokenizer, prompt: str = "Say:", **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r0",
        prompt_token_ids=tokenizer.encode(prompt, add_special_tokens=True),
        sampling_params=SamplingParams(**params),
        eos_token_id=tokenizer.eos_token_id,
        arrival_time=0.0,
    )


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> str:
    """Feed ids `chunk` at a time, collecting streamed deltas."""
    out = ""
    for i in range(0, len(ids), chunk):
        if detok.update(ids[i : i + chunk], False) is not None:
            break
        out += detok.get_next_output_text(finished=False, delta=True)
    return out + detok.get_next_output_text(finished=True, delta=True)


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "prefix_offsets"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_full_decode(tokenizer, fast, chunk):
    ids = ids_of(tokenizer, TEXT)
    assert len(ids) > len(TEXT) // 4  # multi-byte chars really are split over byte tokens
    detok = IncrementalDetokenizer.from_new_request(tokenizer, make_request(tokenizer), use_fast_decode=fast)
    assert isinstance(detok, FastIncrementalDetokenizer if fast else SlowIncrementalDetokenizer)
    streamed = stream(detok, ids, chunk)
    assert streamed == TEXT == tokenizer.decode(ids)
    assert detok.output_text == TEXT
    assert detok.output_token_ids == ids


def test_first_output_token_keeps_its_leading_space(tokenizer):
    ids = ids_of(tokenizer, " world and more")
    detok = IncrementalDetokenizer.from_new_request(tokenizer, make_request(tokenizer, "Hello"))
    assert stream(detok, ids) == " world and more"


def test_special_tokens_skipped_by_default_and_kept_on_request(tokenizer):
    eos = tokenizer.eos_token_id
    ids = ids_of(tokenizer, "ab") + [eos] + ids_of(tokenizer, " cd")
    skip = IncrementalDetokenizer.from_new_request(tokenizer, make_request(tokenizer))
    assert stream(skip, ids) == "ab cd"
    keep = IncrementalDetokenizer.from_new_request(tokenizer, make_request(tokenizer, skip_special_tokens=False))
    assert stream(keep, ids) == "ab</s> cd"


def test_no_spaces_between_consecutive_special_tokens_when_disabled(tokenizer):
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    ids = [bos, eos, eos] + ids_of(tokenizer, "x")
    req = make_request(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False)
    for fast in (True, False):
        detok = IncrementalDetokenizer.from_new_request(tokenizer, req, use_fast_decode=fast)
        assert stream(detok, ids) == "<s></s></s>x"


def test_slow_path_puts_spaces_between_special_tokens_by_default(tokenizer):
    eos = tokenizer.eos_token_id
    ids = ids_of(tokenizer, "ab") + [eos, eos] + ids_of(tokenizer, "cd")
    req = make_request(tokenizer, skip_special_tokens=False)
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req, use_fast_decode=False)
    assert stream(detok, ids) == "ab </s> </s> cd"


def test_detokenize_false_keeps_ids_and_no_text(tokenizer):
    ids = ids_of(tokenizer, "some text")
    detok = IncrementalDetokenizer.from_new_request(tokenizer, make_request(tokenizer, detokenize=False))
    assert stream(detok, ids) == ""
    assert detok.output_text == ""
    assert detok.output_token_ids == ids


def test_unknown_token_id_yields_no_text_and_later_tokens_still_decode(tokenizer):
    detok = IncrementalDetokenizer.from_new_request(tokenizer, make_request(tokenizer))
    ids = ids_of(tokenizer, "abc") + [len(tokenizer) + 50] + ids_of(tokenizer, " def")
    assert stream(detok, ids) == "abc def"


# ---------------------------------------------------------------- stop strings


def test_find_stop_string_returns_earliest_match_and_cut_position():
    assert find_stop_string("hello STOP there END", 20, ["END", "STOP"], False) == ("STOP", 6)
    assert find_stop_string("hello STOP there", 10, ["STOP"], True) == ("STOP", 10)
    assert find_stop_string("hello", 5, ["x"], False) is None


def test_find_stop_string_ignores_matches_entirely_in_already_checked_text():
    # "STOP" ends 4 chars before the new text began: already checked, must not match again.
    assert find_stop_string("STOP....abc", 3, ["STOP"], False) is None
    # A match straddling old and new text is found.
    assert find_stop_string("xxST" + "OP", 2, ["STOP"], False) == ("STOP", 2)


def test_stop_prefix_holdback_counts_only_a_real_stop_prefix():
    assert stop_prefix_holdback("hello wo", ["world"]) == 2
    assert stop_prefix_holdback("hello w", ["world", "xyz"]) == 1
    assert stop_prefix_holdback("hello", ["world"]) == 0
    assert stop_prefix_holdback("ab", ["abc"]) == 2


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens_is_caught_and_cut(tokenizer, include):
    text = "The answer is 42 STOP and then more text"
    ids = ids_of(tokenizer, text)
    # Check the stop string really spans several tokens.
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "STOP" not in pieces
    req = make_request(tokenizer, stop=["STOP"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req)
    stop_hit = None
    consumed = 0
    for t in ids:
        consumed += 1
        stop_hit = detok.update([t], False)
        if stop_hit is not None:
            break
    assert stop_hit == "STOP"
    expected = "The answer is 42 STOP" if include else "The answer is 42 "
    assert detok.output_text == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected
    # Caught at the token that completed it, not later.
    assert "STOP" in tokenizer.decode(ids[:consumed]) and "STOP" not in tokenizer.decode(ids[: consumed - 1])


def test_stop_string_inside_one_multi_token_update_truncates_later_text(tokenizer):
    ids = ids_of(tokenizer, "abc END def END ghi")
    req = make_request(tokenizer, stop=["END"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req)
    assert detok.update(ids, False) == "END"
    assert detok.output_text == "abc END"


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer):
    ids = ids_of(tokenizer, "one two thr three four")
    req = make_request(tokenizer, stop=["three"])
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req)
    seen = ""
    for t in ids:
        if detok.update([t], False) is not None:
            break
        seen += detok.get_next_output_text(finished=False, delta=True)
        # Nothing streamed may be a prefix of "three" at the tail that then gets cut.
        assert detok.output_text.startswith(seen)
        pending = detok.output_text[len(seen) :]
        # Exactly the tail that could still grow into "three" is withheld.
        assert "three".startswith(pending) and len(pending) < len("three")
        if detok.output_text.endswith("thr"):
            assert pending == "thr"
    final = seen + detok.get_next_output_text(finished=True, delta=True)
    assert final == "one two thr "
    # "thr" was held back while it could still have become "three", then released.
    cumulative = IncrementalDetokenizer.from_new_request(tokenizer, req)
    cumulative.update(ids_of(tokenizer, "one two thr"), False)
    assert cumulative.get_next_output_text(finished=False, delta=False) == "one two "
    assert cumulative.get_next_output_text(finished=True, delta=False) == "one two thr"


def test_stop_terminated_token_text_is_not_output(tokenizer):
    stop_tok = ids_of(tokenizer, "!")[0]
    ids = ids_of(tokenizer, "hi") + [stop_tok]
    req = make_request(tokenizer, stop_token_ids=[stop_tok])
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req)
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.output_text == "hi"
    assert detok.output_token_ids == ids  # the id itself is still reported
    kept = IncrementalDetokenizer.from_new_request(
        tokenizer, make_request(tokenizer, stop_token_ids=[stop_tok], include_stop_str_in_output=True)
    )
    kept.update(ids, stop_terminated=True)
    assert kept.output_text == "hi!"


def test_min_tokens_delays_stop_string_matching(tokenizer):
    ids = ids_of(tokenizer, "a b c d e f")
    req = make_request(tokenizer, stop=["b"], min_tokens=4)
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req)
    hits = [detok.update([t], False) for t in ids]
    assert hits[:4] == [None] * 4  # "b" appears in the first 4 tokens but may not stop yet
    assert "b" not in hits


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A Llama-style tokenizer: Metaspace pre-tokenizer, byte fallback, and a decoder that strips
    the first leading space (so decoding output ids alone would lose the space after the prompt)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello world, this is a small corpus.", "The world is wide and the sea is deep.", "Hello again"] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(256):  # byte-fallback tokens are ordinary vocabulary entries, as in Llama
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "prefix_offsets"])
def test_sentencepiece_style_output_keeps_space_after_prompt_and_joins_byte_fallback(metaspace_tokenizer, fast):
    tok = metaspace_tokenizer
    prompt = tok.encode("Hello", add_special_tokens=False)
    full = tok.encode("Hello world is wide \u00fc", add_special_tokens=False)
    out = full[len(prompt) :]
    assert "<0xC3>" in tok.convert_ids_to_tokens(out)  # "ü" really is two byte tokens
    assert tok.decode(out) == "world is wide \u00fc"  # decoding alone loses the space
    req = EngineCoreRequest("r", prompt, SamplingParams(), tok.eos_token_id, 0.0)
    detok = IncrementalDetokenizer.from_new_request(tok, req, use_fast_decode=fast)
    assert stream(detok, out) == " world is wide \u00fc"
