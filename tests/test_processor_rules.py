"""The frontend Processor's rules, one at a time: prompt shapes and bounds, the text-size guard, priority,
generation_config defaults and EOS ids, per-request caps and the filled-in copy of the params.

Real Processor over the tiny checkpoint's tokenizer (loaded once per module); no engine, no model forward.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Optional

import numpy as np
import pytest
import torch

from vllm_lite.client import processor as processor_mod
from vllm_lite.client.processor import (
    MAX_BEST_OF,
    MAX_N,
    PRIORITY_MAX,
    PRIORITY_MIN,
    PROMPT_CHARS_SLACK,
    Processor,
    check_priority,
    check_prompt_text,
    max_chars_per_token,
    max_prompt_chars,
    read_generation_config,
)
from vllm_lite.config import ModelConfig
from vllm_lite.pooling_config import PoolerConfig
from vllm_lite.pooling_params import GENERATE_ON_POOLING, POOLING_ON_GENERATE, PoolingParams
from vllm_lite.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_lite.testing.checkpoints import get_checkpoint

MAX_LEN = 16
VOCAB = 2000  # the tiny checkpoint's tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_checkpoint("llama"))


def make(
    tokenizer: Any,
    model_dir: str,
    gen_config: Optional[Any] = None,
    *,
    generation_config: str = "auto",
    vocab_size: Optional[int] = VOCAB,
    max_model_len: int = MAX_LEN,
    **kw: Any,
) -> Processor:
    os.makedirs(model_dir, exist_ok=True)
    if gen_config is not None:
        with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
            f.write(gen_config if isinstance(gen_config, str) else json.dumps(gen_config))
    cfg = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        dtype=torch.float32,
        max_model_len=max_model_len,
        hf_config={},
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,  # type: ignore[arg-type]
        generation_config=generation_config,
    )
    return Processor(cfg, tokenizer, **kw)


@pytest.fixture()
def proc(tokenizer, tmp_path) -> Processor:
    return make(tokenizer, str(tmp_path / "model"))


class NoEosTokenizer:
    """A tokenizer with no EOS id of its own (the checkpoint's generation_config must supply it)."""

    eos_token_id = None

    def __len__(self) -> int:
        return 50


# ---------------------------------------------------------------------------- the text-size guard


class Vocab:
    """A tokenizer stand-in whose vocabulary is given (weak-referenceable, like HF tokenizers)."""

    def __init__(self, vocab: Any) -> None:
        self.vocab = vocab
        self.calls = 0

    def get_vocab(self) -> Any:
        self.calls += 1
        return self.vocab


def test_the_longest_token_bounds_characters_per_token_and_is_read_once_per_tokenizer():
    tok = Vocab({"a": 0, "abcde": 1, "abc": 2, 7: 3})  # a non-str key is not a token's text
    assert max_chars_per_token(tok) == 5 and max_chars_per_token(tok) == 5
    assert tok.calls == 1
    other = Vocab({"abcdefg": 0})
    assert max_chars_per_token(other) == 7  # a different tokenizer gets its own bound


def test_an_empty_or_unreadable_vocabulary_still_gives_a_usable_bound():
    assert max_chars_per_token(Vocab({})) == 1
    assert max_chars_per_token(Vocab({"": 0})) == 1

    class Broken:
        def get_vocab(self) -> Any:
            raise RuntimeError("no vocabulary")

    assert max_chars_per_token(Broken()) == 1 << 16


def test_a_tokenizer_that_cannot_be_weakly_referenced_is_measured_every_time():
    class Slotted:
        __slots__ = ("calls",)

        def __init__(self) -> None:
            self.calls = 0

        def get_vocab(self) -> dict:
            self.calls += 1
            return {"abcd": 0}

    tok = Slotted()
    assert max_chars_per_token(tok) == 4 and max_chars_per_token(tok) == 4
    assert tok.calls == 2


def test_the_prompt_character_cap_is_tokens_times_longest_token_times_the_slack():
    tok = Vocab({"abc": 0})
    assert PROMPT_CHARS_SLACK == 4
    assert max_prompt_chars(10, tok) == 10 * 3 * 4


def test_text_at_the_cap_passes_and_one_character_more_is_refused_naming_the_field_and_numbers():
    tok = Vocab({"ab": 0})
    limit = max_prompt_chars(3, tok)
    check_prompt_text("x" * limit, 3, tok)
    with pytest.raises(ValueError) as e:
        check_prompt_text("x" * (limit + 1), 3, tok, field="bad_words")
    msg = str(e.value)
    assert msg.startswith("The bad_words is too long:"), msg
    assert f"{limit + 1} characters" in msg and "max_model_len=3" in msg and f"at most {limit} characters" in msg
    assert msg.endswith("Please reduce the length of the bad_words."), msg
    with pytest.raises(ValueError, match="^The prompt is too long"):
        check_prompt_text("x" * (limit + 1), 3, tok)


def test_a_lone_surrogate_is_refused_naming_the_code_point_and_position():
    with pytest.raises(ValueError) as e:
        check_prompt_text("ok \udc80 no", 100, Vocab({"a": 0}), field="prompt")
    msg = str(e.value)
    assert msg.startswith("The prompt is not valid Unicode text") and "(U+DC80) at character 3" in msg, msg
    assert e.value.__cause__ is None and e.value.__suppress_context__  # not the codec's traceback


def test_a_text_prompt_over_the_cap_is_refused_before_tokenizing(proc):
    limit = max_prompt_chars(MAX_LEN, proc.tokenizer)
    with pytest.raises(ValueError, match="^The prompt is too long"):
        proc.process_inputs("a", "x" * (limit + 1), SamplingParams())


# ---------------------------------------------------------------------------- priority


@pytest.mark.parametrize("value", [PRIORITY_MIN, PRIORITY_MAX, 0, -5])
def test_priority_is_accepted_on_each_64_bit_bound(value):
    assert check_priority(value) == value


@pytest.mark.parametrize("value", [PRIORITY_MIN - 1, PRIORITY_MAX + 1])
def test_priority_just_past_either_bound_is_refused_naming_both_bounds(value):
    with pytest.raises(ValueError) as e:
        check_priority(value)
    assert str(e.value) == f"priority must be between {-(2**63)} and {2**63 - 1} (64-bit), got {value}."


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None])
def test_priority_must_be_a_real_int(value):
    with pytest.raises(TypeError, match=f"^priority must be an int, got {re.escape(repr(value))}\\.$"):
        check_priority(value)


def test_the_request_carries_its_priority_client_salt_and_arrival_time(proc):
    _, req = proc.process_inputs(
        "r", [5], SamplingParams(), arrival_time=3, priority=-7, client_index=2, cache_salt="s"
    )
    assert (req.priority, req.client_index, req.cache_salt) == (-7, 2, "s")
    assert req.arrival_time == 3.0 and isinstance(req.arrival_time, float)
    before = time.time()
    _, req = proc.process_inputs("r", [5], SamplingParams())
    assert before <= req.arrival_time <= time.time()  # stamped now when not given
    assert (req.priority, req.client_index, req.cache_salt) == (0, 0, None)


@pytest.mark.parametrize("salt", [5, b"s", ["s"]])
def test_cache_salt_must_be_a_string(proc, salt):
    with pytest.raises(TypeError, match="^cache_salt must be a str or None, got "):
        proc.process_inputs("r", [5], SamplingParams(), cache_salt=salt)


@pytest.mark.parametrize("request_id", [None, 5, ""])
def test_request_id_must_be_a_non_empty_string(proc, request_id):
    with pytest.raises(TypeError, match=f"^request_id must be a non-empty str, got {re.escape(repr(request_id))}\\.$"):
        proc.process_inputs(request_id, [5], SamplingParams())


def test_params_of_another_type_are_refused_naming_the_type(proc):
    with pytest.raises(TypeError, match="^params must be a SamplingParams.*got dict.$"):
        proc.process_inputs("r", [5], {"max_tokens": 1})


# ---------------------------------------------------------------------------- pooling requests


@pytest.fixture()
def pooling(tokenizer, tmp_path) -> Processor:
    p = make(tokenizer, str(tmp_path / "pool"))
    p.model_config.runner_type = "pooling"
    p.model_config.pooler_config = PoolerConfig(pooling_type="LAST", normalize=True)
    return p


def test_a_pooling_model_refuses_sampling_params_and_a_generative_one_pooling_params(proc, pooling):
    with pytest.raises(ValueError, match=f"^{re.escape(GENERATE_ON_POOLING)}$"):
        pooling.process_inputs("r", [5], SamplingParams())
    with pytest.raises(ValueError, match=f"^{re.escape(POOLING_ON_GENERATE)}$"):
        proc.process_inputs("r", [5], PoolingParams())


def test_a_pooling_prompt_may_fill_the_whole_context_and_gets_no_sampling_params(pooling):
    _, req = pooling.process_inputs("r", [5] * MAX_LEN, PoolingParams(), priority=3, client_index=1, cache_salt="s")
    assert req.prompt_token_ids == [5] * MAX_LEN and req.sampling_params is None
    assert req.pooling_params.normalize is True and (req.priority, req.client_index, req.cache_salt) == (3, 1, "s")


@pytest.mark.parametrize(
    "ids, says",
    [
        ([], r"^Invalid prompt: prompt is empty \(no token ids\)\.$"),
        ([0, VOCAB], f"token id {VOCAB}, out of vocabulary"),
    ],
)
def test_a_pooling_prompt_is_checked_like_any_other(pooling, ids, says):
    with pytest.raises(ValueError, match=says):
        pooling.process_inputs("r", ids, PoolingParams())


def test_a_pooling_request_is_still_checked_for_priority_and_salt(pooling):
    with pytest.raises(ValueError, match="priority"):
        pooling.process_inputs("r", [5], PoolingParams(), priority=PRIORITY_MAX + 1)
    with pytest.raises(TypeError, match="cache_salt"):
        pooling.process_inputs("r", [5], PoolingParams(), cache_salt=1)


# ---------------------------------------------------------------------------- prompt shapes


def test_a_dict_prompt_with_ids_needs_a_string_prompt_text_beside_them(proc):
    with pytest.raises(TypeError, match=r"^prompt must be a str, got int\.$"):
        proc.process_inputs("r", {"prompt_token_ids": [5], "prompt": 3}, SamplingParams())
    text, req = proc.process_inputs("r", {"prompt_token_ids": (5, 6)}, SamplingParams())
    assert text is None and req.prompt_token_ids == [5, 6]


def test_a_dict_prompt_without_either_key_is_refused_listing_its_keys(proc):
    with pytest.raises(ValueError) as e:
        proc.process_inputs("r", {"text": "x", "ids": [1]}, SamplingParams())
    assert str(e.value) == "a dict prompt needs a 'prompt' or 'prompt_token_ids' key, got keys ['ids', 'text']."


def test_a_dict_text_prompt_is_tokenized_like_a_plain_one(proc, tokenizer):
    text, req = proc.process_inputs("r", {"prompt": "hello world"}, SamplingParams())
    assert text == "hello world"
    assert req.prompt_token_ids == tokenizer.encode("hello world", add_special_tokens=True)
    assert req.prompt_token_ids[0] == tokenizer.bos_token_id  # special tokens are added


def test_a_text_prompt_needs_a_tokenizer(tmp_path):
    bare = make(None, str(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"^A text prompt needs a tokenizer; pass prompt_token_ids instead\.$"):
        bare.process_inputs("r", "hello", SamplingParams())
    assert bare.process_inputs("r", [1, 2], SamplingParams())[1].prompt_token_ids == [1, 2]


@pytest.mark.parametrize("prompt", [3.5, None, b"bytes", {1, 2}])
def test_a_prompt_of_another_type_is_refused_naming_its_type(proc, prompt):
    with pytest.raises(TypeError) as e:
        proc.process_inputs("r", prompt, SamplingParams())
    assert str(e.value).startswith("prompt must be a str, a list of token ids or a dict")
    assert str(e.value).endswith(f"got {type(prompt).__name__}.")


def test_token_ids_may_be_a_tuple_a_numpy_array_or_a_tensor(proc):
    assert proc.process_inputs("r", (5, 6), SamplingParams())[1].prompt_token_ids == [5, 6]
    ids = proc.process_inputs("r", {"prompt_token_ids": torch.tensor([7, 8])}, SamplingParams())[1].prompt_token_ids
    assert ids == [7, 8] and all(type(t) is int for t in ids)
    ids = proc.process_inputs("r", [np.int64(9)], SamplingParams())[1].prompt_token_ids
    assert ids == [9] and type(ids[0]) is int


@pytest.mark.parametrize("ids, got", [("5 6", "str"), (5, "int"), ({"a": 1}, "dict")])
def test_token_ids_of_another_shape_are_refused_naming_the_field(proc, ids, got):
    with pytest.raises(TypeError, match=f"^prompt_token_ids must be a list of ints, got {got}.$"):
        proc.process_inputs("r", {"prompt_token_ids": ids}, SamplingParams())


def test_a_non_int_id_is_refused_showing_the_first_eight_ids(proc):
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9.0]
    with pytest.raises(TypeError) as e:
        proc.process_inputs("r", ids, SamplingParams())
    assert str(e.value) == "prompt_token_ids must contain only ints, got [1, 2, 3, 4, 5, 6, 7, 8]..."
    with pytest.raises(TypeError, match="^prompt_token_ids must contain only ints"):
        proc.process_inputs("r", [np.float32(1.0)], SamplingParams())


def test_the_prompt_may_fill_all_but_one_position(proc):
    _, req = proc.process_inputs("r", [5] * (MAX_LEN - 1), SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == 1
    with pytest.raises(ValueError) as e:
        proc.process_inputs("r", [5] * MAX_LEN, SamplingParams())
    assert f"{MAX_LEN} tokens, but max_model_len={MAX_LEN} allows at most {MAX_LEN - 1} prompt tokens" in str(e.value)


@pytest.mark.parametrize(
    "ids, bad", [([0, VOCAB - 1], None), ([VOCAB], VOCAB), ([0, VOCAB], VOCAB), ([-1, VOCAB], -1), ([3, -2], -2)]
)
def test_prompt_ids_must_lie_in_the_vocabulary_and_the_error_names_the_offender(proc, ids, bad):
    if bad is None:
        assert proc.process_inputs("r", ids, SamplingParams())[1].prompt_token_ids == ids
        return
    with pytest.raises(ValueError) as e:
        proc.process_inputs("r", ids, SamplingParams())
    assert str(e.value) == f"prompt_token_ids contains token id {bad}, out of vocabulary (size {VOCAB})."


# ---------------------------------------------------------------------------- vocabulary and EOS ids


def test_the_models_vocabulary_decides_and_the_tokenizers_size_is_the_fallback(tokenizer, tmp_path):
    assert make(tokenizer, str(tmp_path / "a"), vocab_size=3000).vocab_size == 3000
    assert make(tokenizer, str(tmp_path / "b"), vocab_size=0).vocab_size == len(tokenizer)
    assert make(None, str(tmp_path / "c"), vocab_size=0).vocab_size == 0


def test_eos_comes_from_the_tokenizer_and_else_from_generation_config(tokenizer, tmp_path):
    assert make(tokenizer, str(tmp_path / "a"), {"eos_token_id": [7, 2]}).eos_token_id == tokenizer.eos_token_id
    no_eos = make(NoEosTokenizer(), str(tmp_path / "b"), {"eos_token_id": [7, 9]})
    assert no_eos.eos_token_id == 7 and no_eos.extra_eos_ids == [9]
    single = make(NoEosTokenizer(), str(tmp_path / "c"), {"eos_token_id": 4})
    assert single.eos_token_id == 4 and single.extra_eos_ids == []
    assert make(None, str(tmp_path / "d"), {"eos_token_id": 4}).eos_token_id == 4
    none = make(NoEosTokenizer(), str(tmp_path / "e"), {"eos_token_id": None})
    assert none.eos_token_id is None and none.extra_eos_ids == []
    assert make(NoEosTokenizer(), str(tmp_path / "f"), {"eos_token_id": []}).eos_token_id is None


def test_extra_eos_ids_stop_unless_eos_is_ignored_and_no_stop_id_repeats(tokenizer, tmp_path):
    p = make(tokenizer, str(tmp_path / "a"), {"eos_token_id": ["7", 2, 3]})  # ids as strings still count
    assert p.extra_eos_ids == [7, 3]
    _, req = p.process_inputs("r", [5], SamplingParams(stop_token_ids=[3, 11, 3]))
    assert req.sampling_params.all_stop_token_ids == [3, 11, 7]
    assert req.eos_token_id == tokenizer.eos_token_id
    _, req = p.process_inputs("r", [5], SamplingParams(stop_token_ids=[11, 11], ignore_eos=True))
    assert req.sampling_params.all_stop_token_ids == [11]


# ---------------------------------------------------------------------------- generation_config


def test_generation_config_is_read_only_when_it_is_a_json_object(tmp_path):
    assert read_generation_config(str(tmp_path / "missing")) == {}
    for i, (text, want) in enumerate(
        [('{"top_k": 3}', {"top_k": 3}), ("[1, 2]", {}), ("{not json", {}), ('"text"', {})]
    ):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "generation_config.json").write_text(text)
        assert read_generation_config(str(d)) == want, text
    unreadable = tmp_path / "dir_instead"
    (unreadable / "generation_config.json").mkdir(parents=True)
    assert read_generation_config(str(unreadable)) == {}


def test_each_generation_config_key_becomes_its_sampling_default(tokenizer, tmp_path):
    gen = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2, "max_new_tokens": 5}
    d = make(tokenizer, str(tmp_path / "a"), gen).get_default_sampling_params()
    got = (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty, d.max_tokens)
    assert got == (0.5, 0.8, 7, 0.1, 1.2, 5)
    nulls = make(tokenizer, str(tmp_path / "b"), {"temperature": None, "top_k": 4}).get_default_sampling_params()
    assert nulls.temperature == SamplingParams().temperature and nulls.top_k == 4


def test_generation_config_vllm_means_no_defaults_and_a_path_reads_that_directory(tokenizer, tmp_path):
    model_dir = str(tmp_path / "model")
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 9, "eos_token_id": [2, 8]}))
    vllm = make(tokenizer, model_dir, {"top_k": 3, "eos_token_id": [2, 5]}, generation_config="vllm")
    assert vllm.generation_config == {} and vllm.get_default_sampling_params().top_k == SamplingParams().top_k
    assert vllm.extra_eos_ids == [5]  # the checkpoint's EOS ids still stop generation
    path = make(tokenizer, model_dir, generation_config=str(other))
    assert path.get_default_sampling_params().top_k == 9
    assert path.extra_eos_ids == [5]  # EOS ids are the checkpoint's, not the defaults directory's
    auto = make(tokenizer, model_dir)
    assert auto.get_default_sampling_params().top_k == 3


# ---------------------------------------------------------------------------- per-request caps


def test_n_and_best_of_are_capped_at_128(proc):
    assert MAX_N == 128 and MAX_BEST_OF == 128
    proc.process_inputs("r", [5], SamplingParams(n=MAX_N))
    proc.process_inputs("r", [5], SamplingParams(n=2, best_of=MAX_BEST_OF))
    with pytest.raises(ValueError, match=f"^n must be at most 128, got {MAX_N + 1}.$"):
        proc.process_inputs("r", [5], SamplingParams(n=MAX_N + 1))
    with pytest.raises(ValueError, match=f"^best_of must be at most 128, got {MAX_BEST_OF + 1}.$"):
        proc.process_inputs("r", [5], SamplingParams(n=1, best_of=MAX_BEST_OF + 1))


def test_logprobs_are_capped_at_max_logprobs_inclusive(tokenizer, tmp_path):
    p = make(tokenizer, str(tmp_path / "a"))
    assert p.max_logprobs == 20
    p.process_inputs("r", [5], SamplingParams(logprobs=20, prompt_logprobs=20))
    with pytest.raises(ValueError, match="^logprobs must be at most 20, got 21.$"):
        p.process_inputs("r", [5], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="^prompt_logprobs must be at most 20, got 21.$"):
        p.process_inputs("r", [5], SamplingParams(prompt_logprobs=21))
    small = make(tokenizer, str(tmp_path / "b"), max_logprobs=2)
    assert small.max_logprobs == 2
    small.process_inputs("r", [5], SamplingParams(logprobs=2, prompt_logprobs=2))
    with pytest.raises(ValueError, match="^logprobs must be at most 2, got 3.$"):
        small.process_inputs("r", [5], SamplingParams(logprobs=3))
    with pytest.raises(ValueError, match="^prompt_logprobs must be at most 2, got 3.$"):
        small.process_inputs("r", [5], SamplingParams(prompt_logprobs=3))


def test_token_id_fields_are_checked_against_the_models_vocabulary(tokenizer, tmp_path):
    p = make(tokenizer, str(tmp_path / "a"), vocab_size=100)
    p.process_inputs("r", [5], SamplingParams(stop_token_ids=[99], allowed_token_ids=[99], logit_bias={99: 1.0}))
    with pytest.raises(ValueError, match="^allowed_token_ids contains a token id out of vocabulary \\(size 100\\)"):
        p.process_inputs("r", [5], SamplingParams(allowed_token_ids=[100]))


def test_a_structured_output_constraint_is_compiled_at_intake(proc):
    _, req = proc.process_inputs("r", [5], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    assert req.sampling_params.structured_outputs.regex == "a+"
    with pytest.raises(ValueError):
        proc.process_inputs("r", [5], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))


def test_max_tokens_left_unset_fills_the_rest_of_the_context_and_a_set_one_stays(proc):
    _, req = proc.process_inputs("r", [5, 6, 7, 8], SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == MAX_LEN - 4
    _, req = proc.process_inputs("r", [5, 6, 7, 8], SamplingParams(max_tokens=3))
    assert req.sampling_params.max_tokens == 3


def test_the_request_gets_a_filled_in_copy_and_the_callers_params_stay_as_they_were(proc):
    params = SamplingParams(max_tokens=None, stop_token_ids=[4, 4], bad_words=["hello"])
    _, req = proc.process_inputs("r", [5], params)
    assert req.sampling_params is not params
    assert params.max_tokens is None and params.all_stop_token_ids == [4, 4] and params.bad_words_token_ids == []
    assert req.sampling_params.all_stop_token_ids == [4] and req.sampling_params.bad_words_token_ids


# ---------------------------------------------------------------------------- bad words


def test_bad_words_are_tokenized_bare_and_after_a_space_without_duplicates(proc, tokenizer):
    _, req = proc.process_inputs("r", [5], SamplingParams(bad_words=["  hello", "hello"]))
    bare = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert bare != spaced
    assert req.sampling_params.bad_words_token_ids == [bare, spaced]  # leading spaces stripped, no BOS added


def test_no_bad_words_means_no_token_sequences(proc):
    assert proc.process_inputs("r", [5], SamplingParams())[1].sampling_params._bad_words_token_ids is None


@pytest.mark.parametrize("word", [" ", "\t\n"])
def test_a_blank_bad_word_is_refused(proc, word):
    with pytest.raises(ValueError, match=f"^{re.escape(f'bad_words must contain non-blank strings, got {word!r}.')}$"):
        proc.process_inputs("r", [5], SamplingParams(bad_words=["ok", word]))


def test_bad_words_need_a_tokenizer(tmp_path):
    bare = make(None, str(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"^bad_words needs a tokenizer\.$"):
        bare.process_inputs("r", [1], SamplingParams(bad_words=["x"]))


def test_a_bad_word_longer_than_any_context_is_refused_before_tokenizing(proc):
    limit = max_prompt_chars(MAX_LEN, proc.tokenizer)
    with pytest.raises(ValueError, match="^The bad_words is too long"):
        proc.process_inputs("r", [5], SamplingParams(bad_words=["x" * (limit + 1)]))


def test_bad_words_whose_tokens_the_model_lacks_are_refused(tokenizer, tmp_path):
    ids = tokenizer.encode("hello", add_special_tokens=False) + tokenizer.encode(" hello", add_special_tokens=False)
    small = make(tokenizer, str(tmp_path / "a"), vocab_size=max(ids))  # the largest id is just out of range
    with pytest.raises(ValueError, match=r"^bad_words tokenized to ids out of vocabulary \(size \d+\)"):
        small.process_inputs("r", [5], SamplingParams(bad_words=["hello"]))
    fits = make(tokenizer, str(tmp_path / "b"), vocab_size=max(ids) + 1)
    assert fits.process_inputs("r", [5], SamplingParams(bad_words=["hello"]))[1].sampling_params.bad_words_token_ids


def test_the_module_caps_match_vllms_values():
    assert (processor_mod.PRIORITY_MIN, processor_mod.PRIORITY_MAX) == (-(2**63), 2**63 - 1)


def test_an_empty_prompt_gets_the_exact_reason(proc):
    with pytest.raises(ValueError) as e:
        proc.process_inputs("r", [], SamplingParams())
    assert str(e.value) == "Invalid prompt: prompt is empty (no token ids)."


class IdZeroTokenizer:
    """Encodes every text to token id 0 (a real id: the first in the vocabulary)."""

    eos_token_id = 1

    def __len__(self) -> int:
        return 8

    def get_vocab(self) -> dict:
        return {"a": 0}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0]


def test_a_bad_word_made_of_token_id_zero_is_accepted(tmp_path):
    p = make(IdZeroTokenizer(), str(tmp_path / "m"), vocab_size=8)
    assert p.process_inputs("r", [1], SamplingParams(bad_words=["a"]))[1].sampling_params.bad_words_token_ids == [[0]]
