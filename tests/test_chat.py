"""LLM.chat renders conversations with the chat template and generates for one or many of them."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.entrypoints.chat_utils import chat_prompts, is_batch_of_conversations
from vllm_lite.testing.checkpoints import get_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONV_A = [{"role": "user", "content": "What does the for statement do?"}]
CONV_B = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Explain exceptions."},
    {"role": "assistant", "content": "They signal errors."},
    {"role": "user", "content": "And the raise statement?"},
]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model=get_checkpoint("llama"), dtype="float32", multiprocess=False, max_model_len=256)
    yield engine
    engine.shutdown()


def test_chat_prompt_is_the_rendered_template_tokenized_without_extra_special_tokens(llm) -> None:
    tok = llm.get_tokenizer()
    (out,) = llm.chat(CONV_A, GREEDY, use_tqdm=False)
    text = tok.apply_chat_template(CONV_A, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text == "<|user|>\nWhat does the for statement do?</s>\n<|assistant|>\n"
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids[0] != tok.bos_token_id  # the template decides about BOS, not the tokenizer
    same = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6


def test_chat_batch_of_conversations_keeps_order_and_matches_single_calls(llm) -> None:
    outs = llm.chat([CONV_A, CONV_B, CONV_A], GREEDY, use_tqdm=False)
    assert len(outs) == 3
    single_a = llm.chat(CONV_A, GREEDY, use_tqdm=False)[0]
    single_b = llm.chat(CONV_B, GREEDY, use_tqdm=False)[0]
    assert outs[0].prompt == single_a.prompt and outs[1].prompt == single_b.prompt
    assert outs[1].prompt.startswith("<|system|>\nYou answer briefly.</s>\n")
    assert outs[0].outputs[0].token_ids == single_a.outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == single_b.outputs[0].token_ids


def test_chat_takes_one_sampling_params_per_conversation(llm) -> None:
    outs = llm.chat(
        [CONV_A, CONV_B],
        [
            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]


def test_chat_add_generation_prompt_false_omits_the_assistant_header(llm) -> None:
    (out,) = llm.chat(CONV_A, GREEDY, add_generation_prompt=False, use_tqdm=False)
    assert out.prompt == "<|user|>\nWhat does the for statement do?</s>\n"


def test_chat_uses_a_given_template_text_or_file_and_template_kwargs(llm, tmp_path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}] {{ m['content'] }}\n{% endfor %}"
    (out,) = llm.chat(CONV_A, GREEDY, chat_template=template, chat_template_kwargs={"greeting": "hi"}, use_tqdm=False)
    assert out.prompt == "[user|hi] What does the for statement do?\n"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    (from_file,) = llm.chat(
        CONV_A, GREEDY, chat_template=str(path), chat_template_kwargs={"greeting": "yo"}, use_tqdm=False
    )
    assert from_file.prompt == "[user|yo] What does the for statement do?\n"


def test_chat_joins_text_content_parts_into_lines(llm) -> None:
    conv = [{"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert out.prompt == "<|user|>\nline one\nline two</s>\n<|assistant|>\n"


def test_chat_continue_final_message_extends_the_assistant_turn(llm) -> None:
    conv = CONV_A + [{"role": "assistant", "content": "It loops"}]
    (out,) = llm.chat(conv, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    assert out.prompt.endswith("<|assistant|>\nIt loops")


@pytest.mark.parametrize(
    "messages,error,match",
    [
        ([], ValueError, "empty"),
        ("hello", TypeError, "list"),
        ([{"content": "no role"}], ValueError, "role"),
        ([{"role": "user"}], ValueError, "content"),
        ([{"role": "user", "content": 5}], TypeError, "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], ValueError, "image_url"),
        ([CONV_A, {"role": "user", "content": "mixed"}], TypeError, "mix"),
        ([CONV_A, []], ValueError, r"messages\[1\]"),
    ],
)
def test_chat_rejects_malformed_messages_naming_the_problem(llm, messages, error, match) -> None:
    with pytest.raises(error, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_chat_rejects_bad_options(llm) -> None:
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(CONV_A, GREEDY, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="assistant"):
        llm.chat(CONV_A, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="tokenize"):
        llm.chat(CONV_A, GREEDY, chat_template_kwargs={"tokenize": True}, use_tqdm=False)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(CONV_A, GREEDY, chat_template="{% if %}", use_tqdm=False)


def test_chat_without_any_template_raises_a_clear_error(tmp_path) -> None:
    path = str(tmp_path / "model")
    shutil.copytree(get_checkpoint("llama"), path)
    os.remove(os.path.join(path, "chat_template.jinja"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert not tok.chat_template
    with pytest.raises(ValueError, match="no chat_template"):
        chat_prompts(tok, CONV_A)
    # A template given by the caller works for such a tokenizer.
    (p,) = chat_prompts(tok, CONV_A, chat_template="{{ messages[0]['content'] }}")
    assert p["prompt"] == CONV_A[0]["content"]


def test_is_batch_of_conversations_tells_one_from_many() -> None:
    assert is_batch_of_conversations([CONV_A, CONV_B]) is True
    assert is_batch_of_conversations(CONV_B) is False
