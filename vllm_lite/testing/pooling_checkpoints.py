"""Random-weight decoder pooling checkpoints (Qwen3-Embedding style, classifiers), built locally like checkpoints.py.

An embedding checkpoint is what sentence-transformers saves for a decoder: the bare decoder as transformers'
AutoModel writes it (`Qwen3Model`: no LM head, tensor names without `model.`), plus `modules.json`, the
Pooling module's `1_Pooling/config.json` and, when the embeddings are normalised, a `2_Normalize` module.
The files follow sentence-transformers' layout (module types under `sentence_transformers.models`, the
pooling mode as its `pooling_mode_*` booleans, which every sentence-transformers version reads).
A classifier checkpoint is `Qwen3ForSequenceClassification` (a `score` head over the last token).
A BERT cross-encoder's tokenizer marks a pair's second text as token type 1, as BERT tokenizers do, and its two
token type embeddings lie far apart, so a pair run with the wrong types scores visibly differently.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from vllm_lite.testing.checkpoints import BOS_ID, EOS_ID, _hf_config, _randomize, build_tokenizer, cached_build

CACHE_VERSION = "v1"
ST_POOLING_MODES = ("lasttoken", "mean", "cls")
# name -> (base arch, what it is saved as, keyword arguments of the builder)
POOLING_CHECKPOINTS: dict[str, dict[str, Any]] = {
    "qwen3-embed-last": dict(arch="qwen3", pooling_mode="lasttoken", normalize=True),
    "qwen3-embed-mean": dict(arch="qwen3", pooling_mode="mean", normalize=False),
    "llama-embed-cls": dict(arch="llama", pooling_mode="cls", normalize=True),
    "qwen3-classify": dict(arch="qwen3", num_labels=3),
    "qwen3-rerank": dict(arch="qwen3", num_labels=1),
    # BERT (encoder): all-MiniLM-style mean + Normalize, CLS without, and a cross-encoder (one label).
    "bert-embed-mean": dict(arch="bert", pooling_mode="mean", normalize=True),
    "bert-embed-cls": dict(arch="bert", pooling_mode="cls", normalize=False),
    "bert-cross-encoder": dict(arch="bert", num_labels=1, typed_pairs=True),
}


def bert_config(vocab_size: int, **overrides: Any):
    """A tiny BertConfig (bert-base's layout scaled down) for our test tokenizer."""
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return transformers.BertConfig(**kwargs)


def write_sentence_transformers_files(path: str, hidden_size: int, pooling_mode: str, normalize: bool) -> None:
    """modules.json + 1_Pooling/config.json (+ 2_Normalize) as sentence-transformers saves them."""
    if pooling_mode not in ST_POOLING_MODES:
        raise ValueError(f"pooling_mode must be one of {ST_POOLING_MODES}, got {pooling_mode!r}.")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f, indent=2)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": pooling_mode == "cls",
        "pooling_mode_mean_tokens": pooling_mode == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling_mode == "lasttoken",
        "include_prompt": True,
    }
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f, indent=2)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 512, "do_lower_case": False}, f, indent=2)


def use_bert_pair_template(path: str) -> None:
    """Rewrite the tokenizer saved in `path` to encode as BERT's does: `<s> A </s>` alone, and a pair as
    `<s> A </s> B </s>` with B and its `</s>` as token type 1, returning `token_type_ids`."""
    from tokenizers import Tokenizer, processors

    file = os.path.join(path, "tokenizer.json")
    tok = Tokenizer.from_file(file)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A:0 </s>:0 $B:1 </s>:1",
        special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)],
    )
    tok.save(file)
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)


def _separate_token_types(model: Any, seed: int) -> None:
    """Token type 1's embedding far from type 0's (random ones are close), so the types change every score."""
    emb = model.bert.embeddings.token_type_embeddings.weight
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb[1].copy_(emb[0] + torch.randn(emb.shape[1], generator=g))


def build_pooling_checkpoint(
    path: str,
    arch: str = "qwen3",
    pooling_mode: str = "lasttoken",
    normalize: bool = True,
    num_labels: int = 0,
    seed: int = 0,
    typed_pairs: bool = False,
) -> str:
    """A tiny random decoder pooling checkpoint in `path`: an embedding model (the bare decoder + sentence-
    transformers files) when num_labels is 0, else `*ForSequenceClassification` with num_labels labels.
    `typed_pairs` (BERT only): the BERT pair template and distinct token type embeddings (a real cross-encoder)."""
    import transformers

    if typed_pairs and arch != "bert":
        raise ValueError(f"typed_pairs needs arch='bert', got {arch!r}.")
    os.makedirs(path, exist_ok=True)
    build_tokenizer(path, vocab_size=2000)
    if typed_pairs:
        use_bert_pair_template(path)
    vocab = len(transformers.AutoTokenizer.from_pretrained(path))
    config = bert_config(vocab) if arch == "bert" else _hf_config(arch, "tiny", vocab, {"pad_token_id": 0})
    if num_labels:
        config.num_labels = num_labels
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    _randomize(model, std=0.1, seed=seed)
    if typed_pairs:
        _separate_token_types(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    if not num_labels:
        write_sentence_transformers_files(path, config.hidden_size, pooling_mode, normalize)
    return path


def get_pooling_checkpoint(name: str) -> str:
    """Path of a cached pooling checkpoint (one of POOLING_CHECKPOINTS), built on first use."""
    if name not in POOLING_CHECKPOINTS:
        raise ValueError(f"name must be one of {sorted(POOLING_CHECKPOINTS)}, got {name!r}.")
    return cached_build(
        f"pooling-{CACHE_VERSION}-{name}", lambda tmp: build_pooling_checkpoint(tmp, **POOLING_CHECKPOINTS[name])
    )
