"""Every SamplingParams field, end to end through `LLM(..., multiprocess=False)` on a tiny float32 model.

Each test fails if its field were ignored on the way (frontend -> core -> sampler ->
detokenizer). Hugging Face's forward on the same weights is the oracle for logits,
logprobs and penalties.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vllm_lite import LLM, SamplingParams
from vllm_lite.testing.checkpoints import EOS_ID, get_checkpoint

PROMPTS = [
    "The for statement is used to iterate over",
    "Exceptions are raised by the raise statement and",
    "A class definition",
]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def path() -> str:
    return get_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(path):
    engine = LLM(model=path, dtype="float32", multiprocess=False, max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _gen(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def _ids(llm, prompt: str) -> list[int]:
    return llm.get_tokenizer()(prompt)["input_ids"]


@torch.no_grad()
def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of ids: row p predicts token p + 1."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


# ---------------------------------------------------------------------- truncation and masks
def test_top_k_1_equals_greedy_even_at_high_temperature(llm) -> None:
    for prompt in PROMPTS:
        greedy = _gen(llm, prompt, max_tokens=16, **GREEDY).token_ids
        top1 = _gen(llm, prompt, temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True).token_ids
        assert top1 == greedy
    # Without top_k the same temperature wanders off greedy (so the equality above is not luck).
    free = [_gen(llm, p, temperature=1.5, max_tokens=16, ignore_eos=True, seed=1).token_ids for p in PROMPTS]
    assert free != [_gen(llm, p, max_tokens=16, **GREEDY).token_ids for p in PROMPTS]


def test_logit_bias_plus_100_forces_its_token_and_minus_100_forbids_it(llm) -> None:
    out = _gen(llm, PROMPTS[0], temperature=1.0, seed=0, max_tokens=10, ignore_eos=True, logit_bias={777: 100.0})
    assert out.token_ids == [777] * 10
    greedy = _gen(llm, PROMPTS[0], max_tokens=10, **GREEDY).token_ids
    banned = _gen(llm, PROMPTS[0], max_tokens=10, logit_bias={greedy[0]: -100.0}, **GREEDY).token_ids
    assert greedy[0] not in banned
    # OpenAI-style string keys work too.
    assert _gen(llm, PROMPTS[1], max_tokens=3, logit_bias={"555": 100}, **GREEDY).token_ids == [555] * 3


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _bad_word_choices(tok, ids: list[int]) -> tuple[str, str]:
    """From a greedy output: a word that is exactly two tokens, and a one-token word not among them."""
    multi = multi_ids = single = None
    for i in range(1, len(ids) - 1):
        pair = tok.decode(ids[i : i + 2])
        if pair.isprintable() and pair == pair.strip() and tok.encode(pair, add_special_tokens=False) == ids[i : i + 2]:
            multi, multi_ids = pair, ids[i : i + 2]
            break
    for t in ids:
        text = tok.decode([t]).strip()
        if multi_ids and t not in multi_ids and text.isalpha() and tok.encode(text, add_special_tokens=False) == [t]:
            single = text
            break
    assert single and multi, "the greedy output should offer a one-token and a two-token word"
    return single, multi


def test_bad_words_never_appear_single_and_multi_token(llm) -> None:
    tok = llm.get_tokenizer()
    greedy = _gen(llm, PROMPTS[0], max_tokens=24, **GREEDY)
    single, multi = _bad_word_choices(tok, greedy.token_ids)
    words = [single, multi]
    banned = [tok.encode(v, add_special_tokens=False) for w in words for v in (w, " " + w)]
    assert len(tok.encode(multi, add_special_tokens=False)) == 2
    assert sum(_contains(greedy.token_ids, b) for b in banned) >= 2  # both words occur without the ban
    for params in (dict(**GREEDY), dict(temperature=1.0, seed=5, ignore_eos=True)):
        out = _gen(llm, PROMPTS[0], max_tokens=24, bad_words=words, **params)
        for b in banned:
            assert not _contains(out.token_ids, b), (b, out.token_ids)
    # A multi-token word bans its last token only right after its prefix: output before it is unchanged.
    first = next(i for i in range(len(greedy.token_ids)) if _contains(greedy.token_ids[: i + 1], banned[2]))
    out = _gen(llm, PROMPTS[0], max_tokens=24, bad_words=[multi], **GREEDY)
    assert out.token_ids[:first] == greedy.token_ids[:first] and out.token_ids[first] != greedy.token_ids[first]


def test_allowed_token_ids_confine_output_and_pick_the_best_allowed(llm, hf) -> None:
    allowed = [101, 202, 303, 404, 505]
    out = _gen(llm, PROMPTS[1], temperature=1.5, seed=3, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1
    ids = _ids(llm, PROMPTS[1])
    first = _gen(llm, PROMPTS[1], max_tokens=1, allowed_token_ids=allowed, **GREEDY).token_ids[0]
    lp = _hf_logprobs(hf, ids)[-1]
    assert first == allowed[int(lp[allowed].argmax())]


# ---------------------------------------------------------------------- stopping
def test_min_tokens_holds_back_eos(llm) -> None:
    eager = _gen(llm, PROMPTS[0], temperature=0.0, max_tokens=20, logit_bias={EOS_ID: 100.0})
    assert eager.token_ids == [EOS_ID] and eager.finish_reason == "stop"
    held = _gen(llm, PROMPTS[0], temperature=0.0, max_tokens=20, logit_bias={EOS_ID: 100.0}, min_tokens=5)
    assert len(held.token_ids) == 6 and held.token_ids[-1] == EOS_ID and EOS_ID not in held.token_ids[:5]
    assert held.finish_reason == "stop" and held.stop_reason is None


def test_min_tokens_holds_back_stop_token_ids_and_reports_the_stop_reason(llm) -> None:
    stop_tok = 888
    kw = dict(temperature=0.0, max_tokens=20, logit_bias={stop_tok: 100.0}, stop_token_ids=[stop_tok])
    eager = _gen(llm, PROMPTS[2], **kw)
    assert eager.token_ids == [stop_tok] and eager.stop_reason == stop_tok and eager.finish_reason == "stop"
    held = _gen(llm, PROMPTS[2], min_tokens=3, **kw)
    assert held.token_ids[-1] == stop_tok and len(held.token_ids) == 4 and stop_tok not in held.token_ids[:3]
    assert held.stop_reason == stop_tok


def test_stop_token_ids_end_at_the_first_occurrence(llm) -> None:
    greedy = _gen(llm, PROMPTS[0], max_tokens=24, **GREEDY).token_ids
    stop_tok = greedy[5]
    first = greedy.index(stop_tok)
    out = _gen(llm, PROMPTS[0], max_tokens=24, stop_token_ids=[stop_tok], **GREEDY)
    assert out.token_ids == greedy[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(greedy[:first])  # the stop token's text is not in the output


def _greedy_text_and_bounds(llm, prompt: str) -> tuple[str, list[int]]:
    """Greedy text, and the text length after each token (an ASCII-only prompt keeps these exact)."""
    out = _gen(llm, prompt, max_tokens=24, **GREEDY)
    tok = llm.get_tokenizer()
    bounds = [len(tok.decode(out.token_ids[: i + 1])) for i in range(len(out.token_ids))]
    assert out.text == tok.decode(out.token_ids) and out.text.isascii()
    return out.text, bounds


def test_stop_string_cuts_at_the_right_character_with_and_without_include(llm) -> None:
    text, bounds = _greedy_text_and_bounds(llm, PROMPTS[0])
    # A stop string inside one token's text, whose first occurrence is in the middle of the output.
    k = next(
        i
        for i in range(3, len(bounds))
        if bounds[i] - bounds[i - 1] >= 3 and text.find(text[bounds[i - 1] + 1 : bounds[i]]) == bounds[i - 1] + 1
    )
    at = bounds[k - 1] + 1
    stop = text[at : bounds[k]]
    out = _gen(llm, PROMPTS[0], max_tokens=24, stop=[stop], **GREEDY)
    assert out.text == text[:at] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) == k + 1  # stopped at the token that completed the string
    inc = _gen(llm, PROMPTS[0], max_tokens=24, stop=stop, include_stop_str_in_output=True, **GREEDY)
    assert inc.text == text[: at + len(stop)] and inc.stop_reason == stop
    # Several stop strings: the earliest match in the text wins, whatever the list order.
    early = text[bounds[0] : bounds[0] + 2]
    assert text.find(early) == bounds[0]
    both = _gen(llm, PROMPTS[0], max_tokens=24, stop=[stop, early], **GREEDY)
    assert both.text == text[: bounds[0]] and both.stop_reason == early


def test_stop_string_split_across_tokens_is_found(llm) -> None:
    text, bounds = _greedy_text_and_bounds(llm, PROMPTS[0])
    # Last 2 characters of token k + first 2 of token k + 1, first occurring exactly there.
    k = next(
        i
        for i in range(2, len(bounds) - 1)
        if bounds[i] - bounds[i - 1] >= 2
        and bounds[i + 1] - bounds[i] >= 2
        and text.find(text[bounds[i] - 2 : bounds[i] + 2]) == bounds[i] - 2
    )
    stop = text[bounds[k] - 2 : bounds[k] + 2]
    at = bounds[k] - 2
    out = _gen(llm, PROMPTS[0], max_tokens=24, stop=[stop], **GREEDY)
    assert out.text == text[:at] and out.stop_reason == stop
    assert len(out.token_ids) == k + 2  # the string completes with token k + 1
    inc = _gen(llm, PROMPTS[0], max_tokens=24, stop=[stop], include_stop_str_in_output=True, **GREEDY)
    assert inc.text == text[: at + len(stop)]


# ---------------------------------------------------------------------- n and seeds
def test_n_3_gives_three_distinct_samples_with_indexes(llm) -> None:
    out = llm.generate(
        PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_seed_reproduces_and_different_seeds_differ(llm) -> None:
    kw = dict(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True)
    a = _gen(llm, PROMPTS[1], seed=42, **kw).token_ids
    assert _gen(llm, PROMPTS[1], seed=42, **kw).token_ids == a
    assert _gen(llm, PROMPTS[1], seed=43, **kw).token_ids != a


def _mixed_batch(prompt: str, target: SamplingParams, size: int) -> tuple[list[str], list[SamplingParams]]:
    """`prompt` with `target` in the middle of `size` other requests of every kind."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20, top_p=0.9),
        dict(temperature=1.2, min_p=0.05, seed=5),
        dict(temperature=0.8, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
        dict(temperature=0.0, logprobs=3),
    ]
    prompts, params = [], []
    for i in range(size):
        prompts.append(f"Request {i}: names refer to objects " + "and more " * (i % 5))
        params.append(SamplingParams(max_tokens=8 + i % 17, ignore_eos=True, **kinds[i % len(kinds)]))
    mid = size // 2
    return prompts[:mid] + [prompt] + prompts[mid:], params[:mid] + [target] + params[mid:]


SEEDED = dict(temperature=0.9, top_k=50, top_p=0.9, seed=2024, max_tokens=24, ignore_eos=True)


def test_seeded_request_is_the_same_alone_and_inside_a_batch_of_32(llm) -> None:
    target = SamplingParams(**SEEDED)
    alone = _gen(llm, PROMPTS[0], **SEEDED).token_ids
    prompts, params = _mixed_batch(PROMPTS[0], target, 32)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[16].outputs[0].token_ids == alone
    assert _gen(llm, PROMPTS[0], **SEEDED).token_ids == alone  # and again, after the batch


# One fresh interpreter for both modes (an interpreter start costs more than the generation): the core-process LLM
# first, so that the in-process one samples in an interpreter whose own RNGs nothing has used.
_CHILD = r"""
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
torch.set_num_threads(1)
from vllm_lite import LLM, SamplingParams

def main():
    path, prompt, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    got = {}
    for multiprocess in (True, False):
        llm = LLM(model=path, dtype="float32", multiprocess=multiprocess, max_model_len=256)
        out = llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]
        got[f"multiprocess={multiprocess}"] = [c.token_ids for c in out.outputs]
        llm.shutdown()
    print(json.dumps(got))

if __name__ == "__main__":
    main()
"""


SEEDED_N3 = dict(SEEDED, n=3)


@pytest.fixture(scope="module", autouse=True)
def seeded_child(path, tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """The child above, started with the module (autouse): its interpreter and two engines start on CI's second
    CPU, which the suite otherwise leaves mostly idle, while the in-process tests run; the test reads its answer.
    Output goes to files, so a child that writes much never waits on a pipe nobody reads yet."""
    tmp = tmp_path_factory.mktemp("seeded-child")
    script, out, err = tmp / "child.py", tmp / "stdout", tmp / "stderr"
    script.write_text(_CHILD)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONHASHSEED="random")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(script), path, PROMPTS[0], json.dumps(SEEDED_N3)],
            stdout=stdout,
            stderr=stderr,
            env=env,
        )
    try:
        yield child, out, err
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_seeded_n3_is_the_same_in_other_processes_with_and_without_a_core_process(llm, seeded_child) -> None:
    here = [c.token_ids for c in llm.generate(PROMPTS[0], SamplingParams(**SEEDED_N3), use_tqdm=False)[0].outputs]
    child, out, err = seeded_child
    assert child.wait(300) == 0, err.read_text()[-2000:]
    got = json.loads(out.read_text().strip().splitlines()[-1])
    assert got == {"multiprocess=True": here, "multiprocess=False": here}


def test_greedy_float32_is_the_same_at_batch_sizes_1_7_and_64(llm) -> None:
    target = SamplingParams(max_tokens=24, **GREEDY)
    alone = llm.generate(PROMPTS[1], target, use_tqdm=False)[0].outputs[0].token_ids
    for size in (6, 63):
        prompts, params = _mixed_batch(PROMPTS[1], target, size)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[size // 2].outputs[0].token_ids == alone, f"batch of {size + 1}"


# ---------------------------------------------------------------------- penalties, against HF's logits
@torch.no_grad()
def _reference_greedy_with_penalties(
    hf, prompt: list[int], n: int, presence: float, frequency: float, repetition: float
) -> list[int]:
    """Greedy decoding of HF's logits with vLLM's penalty rules applied by hand (one token at a time)."""
    out: list[int] = []
    for _ in range(n):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for t in set(prompt + out):  # repetition: prompt and output, HF style
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, c in Counter(out).items():  # OpenAI frequency/presence: output only
            logits[t] -= frequency * c + presence
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "presence,frequency,repetition",
    [(1.5, 0.0, 1.0), (0.0, 1.0, 1.0), (0.0, 0.0, 1.8), (-1.0, 0.0, 0.7), (0.5, 0.3, 1.2)],
)
def test_penalties_match_a_reference_on_hf_logits(llm, hf, presence, frequency, repetition) -> None:
    for prompt in PROMPTS[::2]:
        ids = _ids(llm, prompt)
        got = _gen(
            llm,
            prompt,
            max_tokens=12,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            **GREEDY,
        ).token_ids
        assert got == _reference_greedy_with_penalties(hf, ids, 12, presence, frequency, repetition)


@pytest.mark.parametrize(
    "field,discouraging,encouraging",
    [("presence_penalty", 2.0, -2.0), ("frequency_penalty", 2.0, -2.0), ("repetition_penalty", 2.0, 0.5)],
)
def test_penalties_change_repetition_in_the_expected_direction(llm, field, discouraging, encouraging) -> None:
    def distinct(value) -> int:
        toks = []
        for prompt in PROMPTS:
            toks.append(len(set(_gen(llm, prompt, max_tokens=24, **{field: value}, **GREEDY).token_ids)))
        return sum(toks)

    neutral = 1.0 if field == "repetition_penalty" else 0.0
    base = distinct(neutral)
    assert distinct(discouraging) > base
    assert distinct(encouraging) <= base


# ---------------------------------------------------------------------- logprobs
def test_sample_and_prompt_logprobs_match_hf_log_softmax(llm, hf) -> None:
    prompt = PROMPTS[1]
    # Temperature 0.8: logprobs are of the raw model distribution, before temperature (vLLM's default).
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0.8, seed=9, max_tokens=10, logprobs=5, prompt_logprobs=5, ignore_eos=True),
        use_tqdm=False,
    )[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    ref = _hf_logprobs(hf, ids)
    P = len(out.prompt_token_ids)
    assert len(comp.logprobs) == len(comp.token_ids) == 10
    total = 0.0
    for j, (tok_id, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[P - 1 + j]
        top = torch.topk(row, 5)
        assert set(lps) == {tok_id} | set(top.indices.tolist())
        for t, lp in lps.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert lps[tok_id].rank == int((row > row[tok_id]).sum()) + 1
        total += float(row[tok_id])
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-3)

    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == P and plp[0] is None
    for p in range(1, P):
        row, tok_id = ref[p - 1], out.prompt_token_ids[p]
        entry = plp[p]
        assert set(entry) == {tok_id} | set(torch.topk(row, 5).indices.tolist())
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert entry[tok_id].rank == int((row > row[tok_id]).sum()) + 1


def test_greedy_logprobs_of_the_chosen_token_is_the_top_one(llm, hf) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=0, **GREEDY), use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = _hf_logprobs(hf, out.prompt_token_ids + comp.token_ids)
    P = len(out.prompt_token_ids)
    for j, (tok_id, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert list(lps) == [tok_id] and lps[tok_id].rank == 1
        assert tok_id == int(ref[P - 1 + j].argmax())
        assert lps[tok_id].logprob == pytest.approx(float(ref[P - 1 + j, tok_id]), abs=1e-4)
