"""LLM.beam_search returns the beams Hugging Face's generate(num_beams=W) returns, in the same order."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_lite import LLM
from vllm_lite.client.beam_search import BeamSearch
from vllm_lite.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_lite.sampling_params import BeamSearchParams, SamplingParams
from vllm_lite.testing.checkpoints import EOS_ID, PAD_ID, get_checkpoint

PROMPTS = [
    "The for statement is used to iterate",
    "Exceptions are raised by",
    "A class definition defines a class object",
]


@pytest.fixture(scope="module")
def llama_path() -> str:
    return get_checkpoint("llama")


# The EOS chain crafted into the tiny Llama: each prompt's last token -> TRIGGER -> EOS, each by a clear margin.
EOS_PROMPTS = PROMPTS + ["The while statement", "Names refer to objects"]
TRIGGER_TEXT = " end"
MIN_MARGIN = 1.5  # nats between the crafted winner and the runner-up; float32 rounding is ~1e-5


def _trigger_id(tokenizer) -> int:
    return tokenizer(TRIGGER_TEXT, add_special_tokens=False)["input_ids"][-1]


def _craft_eos_chain(path: str, last_ids: list[int], trigger: int, strength: float = 20.0, gain: float = 1.6) -> None:
    """Rewrite the Llama checkpoint at path so the premise of the EOS tests holds by construction.

    Two residual dimensions become private channels: no attention or MLP output writes them, the
    embedding writes `strength` into one only for the prompts' last tokens and into the other only
    for `trigger`, and the LM head reads them only into `trigger`'s and EOS's logits. So after any
    prompt-final token `trigger` wins and EOS is the clear runner-up (a one-token hypothesis), and
    after `trigger` EOS wins, on every device and torch. [trigger, EOS] is then the best-scoring
    hypothesis for every length penalty the tests use (its log-probability is near 0; any other
    beam pays ~6 nats a token), so it is always among the returned beams.
    """
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) == 1
    weights = load_file(os.path.join(path, files[0]))
    hidden = weights["model.norm.weight"].shape[0]
    to_trigger, to_eos = hidden - 2, hidden - 1
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[[to_trigger, to_eos]] = 0
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed[:, [to_trigger, to_eos]] = 0
    embed[last_ids, to_trigger] = strength
    embed[trigger, to_eos] = strength
    weights["model.norm.weight"][[to_trigger, to_eos]] = 1.0
    head[:, [to_trigger, to_eos]] = 0
    head[trigger, to_trigger] = gain
    head[EOS_ID, to_trigger] = gain / 2
    head[EOS_ID, to_eos] = gain
    save_file(weights, os.path.join(path, files[0]), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def eos_prone_path(tmp_path_factory, llama_path) -> str:
    """The tiny Llama with an EOS chain crafted in (see _craft_eos_chain), so beams end with EOS by construction."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("eos-prone") / "model")
    shutil.copytree(llama_path, path)
    tok = AutoTokenizer.from_pretrained(path)
    last_ids = sorted({tok(p)["input_ids"][-1] for p in EOS_PROMPTS})
    trigger = _trigger_id(tok)
    assert trigger not in last_ids and trigger != EOS_ID
    _craft_eos_chain(path, last_ids, trigger)
    return path


def _hf_beams(
    model, tokenizer, prompt: str, width: int, new_tokens: int, length_penalty: float, early_stopping, ignore_eos: bool
) -> tuple[list[list[int]], list[float]]:
    """HF's returned beams (generated tokens up to and including EOS) and their sequence scores."""
    from transformers import GenerationConfig

    ids = tokenizer(prompt)["input_ids"]
    cfg = GenerationConfig(
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=new_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=None if ignore_eos else EOS_ID,
        pad_token_id=PAD_ID,
        bos_token_id=1,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), generation_config=cfg, output_scores=True, return_dict_in_generate=True
        )
    beams = []
    for row in out.sequences.tolist():
        gen = row[len(ids) :]
        if not ignore_eos and EOS_ID in gen:
            gen = gen[: gen.index(EOS_ID) + 1]
        beams.append(gen)
    return beams, out.sequences_scores.tolist()


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_same_beams(ours, hf_beams, hf_scores) -> None:
    got = [s.output_token_ids for s in ours.sequences]
    assert got == hf_beams
    assert [s.score for s in ours.sequences] == pytest.approx(hf_scores, abs=1e-4)


def test_beam_search_ignore_eos_matches_hf_tokens_order_and_scores(llama_path: str) -> None:
    llm = LLM(model=llama_path, dtype="float32", multiprocess=False, max_model_len=256)
    hf, tok = _hf_model(llama_path), llm.get_tokenizer()
    params = BeamSearchParams(beam_width=4, max_tokens=7, ignore_eos=True)
    outs = llm.beam_search([{"prompt": p} for p in PROMPTS], params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        want, scores = _hf_beams(hf, tok, prompt, 4, 7, 1.0, False, ignore_eos=True)
        _assert_same_beams(out, want, scores)
        for seq in out.sequences:
            assert len(seq.output_token_ids) == 7 and seq.finish_reason == "length"
            assert seq.tokens[: seq.num_prompt_tokens] == tok(prompt)["input_ids"]
            assert len(seq.logprobs) == 7
            # The beam's cumulative logprob is the sum of its tokens' logprobs.
            total = sum(lp[t].logprob for lp, t in zip(seq.logprobs, seq.output_token_ids))
            assert seq.cum_logprob == pytest.approx(total, abs=1e-5)
            assert seq.text == tok.decode(seq.tokens)
    llm.shutdown()


# (1.0, False, 3, 12) and (2.0, False, 2, 12) stop early through HF's "cannot improve" heuristic.
@pytest.mark.parametrize(
    "length_penalty,early_stopping,width,new_tokens",
    [
        (1.0, False, 3, 12),
        (2.0, False, 2, 12),
        (1.0, True, 3, 8),
        (2.0, "never", 4, 10),
        (0.0, False, 3, 8),
        (-1.0, True, 3, 8),
        (0.5, "never", 4, 10),
    ],
)
def test_beam_search_with_eos_matches_hf_for_length_penalty_and_early_stopping(
    eos_prone_path: str, length_penalty: float, early_stopping, width: int, new_tokens: int
) -> None:
    llm = LLM(model=eos_prone_path, dtype="float32", multiprocess=False, max_model_len=256)
    hf, tok = _hf_model(eos_prone_path), llm.get_tokenizer()
    params = BeamSearchParams(beam_width=width, max_tokens=new_tokens, length_penalty=length_penalty)
    prompts = EOS_PROMPTS
    outs = llm.beam_search(prompts, params, early_stopping=early_stopping)
    saw_eos = False
    for prompt, out in zip(prompts, outs):
        want, scores = _hf_beams(hf, tok, prompt, width, new_tokens, length_penalty, early_stopping, ignore_eos=False)
        _assert_same_beams(out, want, scores)
        for seq in out.sequences:
            ends_eos = seq.output_token_ids[-1] == EOS_ID
            saw_eos |= ends_eos
            assert seq.finish_reason == ("stop" if ends_eos else "length")
    assert saw_eos, "the EOS-chain checkpoint should end some beams with EOS"
    llm.shutdown()


def _assert_ranked_with_margin(logprobs: torch.Tensor, ranked: list[int]) -> None:
    """`ranked` are the top tokens in that order, each ahead of the next by MIN_MARGIN nats."""
    top = logprobs.topk(len(ranked) + 1)
    assert top.indices[: len(ranked)].tolist() == ranked, f"expected {ranked} on top, got {top.indices.tolist()}"
    gaps = (top.values[:-1] - top.values[1:]).tolist()
    assert min(gaps) >= MIN_MARGIN, f"margins {gaps} below {MIN_MARGIN} nats"


def test_eos_chain_checkpoint_premise_holds_in_hf_and_in_the_engine(eos_prone_path: str) -> None:
    """The premise of the EOS tests, checked: from every prompt trigger then EOS win by a clear margin (HF and ours)."""
    import torch.nn.functional as F

    llm = LLM(model=eos_prone_path, dtype="float32", multiprocess=False, max_model_len=256)
    hf, tok = _hf_model(eos_prone_path), llm.get_tokenizer()
    trigger = _trigger_id(tok)
    outs = llm.generate(EOS_PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    for prompt, out in zip(EOS_PROMPTS, outs):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            for context, ranked in ((ids, [trigger, EOS_ID]), (ids + [trigger], [EOS_ID])):
                logits = hf(torch.tensor([context])).logits[0, -1]
                _assert_ranked_with_margin(F.log_softmax(logits, -1), ranked)
        seq = out.outputs[0]
        assert seq.token_ids == [trigger, EOS_ID] and seq.finish_reason == "stop"
        for step, winner in zip(seq.logprobs, (trigger, EOS_ID)):
            best = max(step.values(), key=lambda lp: lp.logprob)
            runner_up = max(lp.logprob for tok_id, lp in step.items() if tok_id != winner)
            assert best is step[winner] and best.logprob - runner_up >= MIN_MARGIN
    llm.shutdown()


def test_beam_search_shares_prompt_blocks_between_beams_through_the_prefix_cache(llama_path: str) -> None:
    """Every step after the first finds the prompt's full blocks in the cache (forking = sharing blocks)."""
    llm = LLM(model=llama_path, dtype="float32", multiprocess=False, max_model_len=256, block_size=16)
    tok = llm.get_tokenizer()
    prompt_ids = tok("The while statement is used for repeated execution as long as an expression is true. " * 3)[
        "input_ids"
    ]
    assert len(prompt_ids) >= 40
    cached: list[list[int]] = []

    def recording_generate(prompts, params):
        outs = llm._run(prompts, params, None, False)
        cached.append([o.num_cached_tokens for o in outs])
        return outs

    from vllm_lite.client.beam_search import beam_search

    beam_search(
        recording_generate,
        tok,
        [{"prompt_token_ids": prompt_ids}],
        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True),
        EOS_ID,
    )
    full_blocks = (len(prompt_ids) // 16) * 16
    assert len(cached) == 4
    for step in cached[1:]:
        assert len(step) == 2
        assert all(c >= full_blocks for c in step), cached
    llm.shutdown()


def _fake_output(rid: str, dist: dict[int, float]) -> RequestOutput:
    lps = {t: Logprob(lp, rank=i + 1) for i, (t, lp) in enumerate(sorted(dist.items(), key=lambda kv: -kv[1]))}
    best = max(dist, key=dist.get)
    comp = CompletionOutput(0, "", [best], None, [lps], finish_reason="length")
    return RequestOutput(rid, None, [], None, [comp], True)


def test_beam_search_early_stopping_true_stops_once_width_hypotheses_finish() -> None:
    """With a model that always prefers EOS, early_stopping=True ends after W hypotheses, one step each."""
    calls = []

    def generate(prompts, params):
        calls.append(len(prompts))
        # EOS best, then tokens 10, 11, ... with falling logprobs.
        dist = {EOS_ID: -0.1, 10: -2.0, 11: -3.0, 12: -4.0, 13: -5.0}
        return [
            RequestOutput(
                str(i),
                None,
                p["prompt_token_ids"] if isinstance(p, dict) else [5, 6],
                None,
                _fake_output(str(i), dist).outputs,
                True,
            )
            for i, p in enumerate(prompts)
        ]

    search = BeamSearch(generate, BeamSearchParams(beam_width=2, max_tokens=10), EOS_ID, early_stopping=True)
    steps = []
    (beams,) = search.run([[5, 6]], on_step=lambda: steps.append(1))
    # Step 1: EOS (finished) and 10 live; step 2 from [10]: EOS finishes -> 2 hypotheses -> stop.
    assert [b.output_token_ids for b in beams] == [[EOS_ID], [10, EOS_ID]]
    assert beams[0].score == pytest.approx(-0.1)
    assert beams[1].score == pytest.approx((-2.0 - 0.1) / 2)
    assert calls == [1, 2] and len(steps) == 2


def test_beam_search_rejects_bad_parameters(llama_path: str) -> None:
    llm = LLM(model=llama_path, dtype="float32", multiprocess=False, max_model_len=64)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search("hello", BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("hello", {"beam_width": 2, "max_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="early_stopping"):
        llm.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=2), early_stopping="sometimes")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=63))
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    llm.shutdown()
