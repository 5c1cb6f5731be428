"""The bundled default model: present, small, loadable, trained, and run correctly by our engine."""

from __future__ import annotations

import json
import os
import re
import zipfile

import pytest
import torch

from vllm_lite.default_model import DEFAULT_MODEL_NAME, default_model_path, resolve_model
from vllm_lite.testing.english import english_fraction, known_words

# Python-documentation-style English written for this test: not in the training corpus.
UNSEEN_TEXT = (
    "The while statement is used for repeated execution as long as an expression is true. "
    "If the expression is false the first time it is tested, the suite of the else clause, "
    "if present, is executed and the loop terminates. This function returns a new list "
    "containing all items from the iterable in ascending order. A custom key function can be "
    "supplied to customize the sort order, and the reverse flag can be set to request the "
    "result in descending order. Raise a ValueError if the argument is not a valid string."
)


@pytest.fixture(scope="module")
def path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


# ---------------------------------------------------------------------------- files
def test_default_model_path_is_a_complete_checkpoint_dir(path):
    assert os.path.isabs(path) and os.path.isdir(path)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "TRAINING.md",
    ):
        assert os.path.isfile(os.path.join(path, name)), name


def test_resolve_model_uses_the_default_only_when_none_is_named(path, tmp_path):
    assert resolve_model(None) == path and resolve_model("") == path
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(TypeError, match="model"):
        resolve_model(3)  # type: ignore[arg-type]
    assert DEFAULT_MODEL_NAME == "vllm-lite-default"


def test_weights_are_small_bf16_llama_with_tied_embeddings(path):
    from safetensors import safe_open

    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 10 * 1024 * 1024
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg.get("torch_dtype") == "bfloat16"
    n = 0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        for k in keys:
            t = f.get_tensor(k)
            assert t.dtype == torch.bfloat16, k
            n += t.numel()
    assert "lm_head.weight" not in keys  # tied: stored once
    assert 2_000_000 <= n <= 8_000_000, n


def test_tokenizer_has_bos_eos_and_a_chat_template(tokenizer, path):
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.bos_token == "<|endoftext|>"
    ids = tokenizer.encode("The for statement")
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The for statement"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert sorted(gen["eos_token_id"]) == sorted([tokenizer.eos_token_id, im_end])
    # Older transformers read the template from tokenizer_config.json only.
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]


def test_training_md_records_losses_params_and_command(path):
    with open(os.path.join(path, "TRAINING.md")) as f:
        text = f.read()
    assert "held-out loss, trained" in text and "held-out loss, untrained" in text
    assert "python scripts/train_default_model.py" in text
    trained = float(re.search(r"held-out loss, trained\*\* \| \*\*([\d.]+)", text).group(1))
    untrained = float(re.search(r"held-out loss, untrained \| ([\d.]+)", text).group(1))
    assert trained < untrained - 2.0


# ---------------------------------------------------------------------------- learned something
def test_trained_model_beats_random_init_on_unseen_documentation(tokenizer, hf_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = torch.tensor([tokenizer.encode(UNSEEN_TEXT)])
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_model_path())).float().eval()
    trained_loss, untrained_loss = _loss(hf_model, ids), _loss(untrained, ids)
    assert untrained_loss > 7.5  # about ln(vocab): knows nothing
    assert trained_loss < untrained_loss - 2.5, (trained_loss, untrained_loss)


def test_trained_model_prefers_real_text_to_shuffled_words(tokenizer, hf_model):
    words = UNSEEN_TEXT.split()
    shuffled = " ".join(words[i] for i in torch.randperm(len(words), generator=torch.Generator().manual_seed(0)))
    real = _loss(hf_model, torch.tensor([tokenizer.encode(UNSEEN_TEXT)]))
    fake = _loss(hf_model, torch.tensor([tokenizer.encode(shuffled)]))
    assert real < fake - 0.3, (real, fake)  # it learned word order, not only word frequencies


# ---------------------------------------------------------------------------- our engine runs it
@pytest.mark.slow
def test_engine_greedy_matches_transformers_and_reads_as_english(path, tokenizer, hf_model):
    from vllm_lite import LLM, SamplingParams

    prompt = "The for statement"
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        ref = hf_model.generate(
            ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id
        )[0, ids.shape[1] :].tolist()
    llm = LLM(model=path, dtype="float32", num_threads=1, multiprocess=False)
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0].outputs[0]
        # The whole continuation, not a prefix: stopping early (or late) is a mismatch. HF stops on the
        # same EOS ids and keeps the EOS token, as the engine does.
        eos_ids = hf_model.generation_config.eos_token_id
        eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] in eos_ids else "length")
        assert len(ref) >= 8  # the premise: a continuation long enough to compare
        # With the model's own defaults (repetition penalty, mild sampling) the text is English-like.
        params = llm.get_default_sampling_params()
        assert params.repetition_penalty > 1.0
        params.max_tokens, params.seed = 32, 0
        text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.llm_engine.shutdown()
    assert english_fraction(text, known_words()) >= 0.7, text


# ---------------------------------------------------------------------------- packaging
@pytest.mark.slow
def test_wheel_includes_the_default_model(project_wheel):
    names = set(zipfile.ZipFile(project_wheel).namelist())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert f"vllm_lite/assets/default_model/{f}" in names, f
