"""Random-weight decoder pooling checkpoints (Qwen3-Embedding style, classifiers), built locally like checkpoints.py.

An embedding checkpoint is what sentence-transformers saves for a decoder: the bare decoder as transformers'
AutoModel writes it (`Qwen3Model`: no LM head, tensor names without `model.`), plus `modules.json`, the
Pooling module's `1_Pooling/config.json` and, when the embeddings are normalised, a `2_Normalize` module.
The files follow sentence-transformers' layout (module types under `sentence_transformers.models`, the
pooling mode as its `pooling_mode_*` booleans, which every sentence-transformers version reads).
A classifier checkpoint is `Qwen3ForSequenceClassification` (a `score` head over the last token).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch

from vllm_lite.testing.checkpoints import _hf_config, _randomize, build_tokenizer, cache_dir

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
    "bert-rerank": dict(arch="bert", num_labels=1),
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


def build_pooling_checkpoint(
    path: str,
    arch: str = "qwen3",
    pooling_mode: str = "lasttoken",
    normalize: bool = True,
    num_labels: int = 0,
    seed: int = 0,
) -> str:
    """A tiny random decoder pooling checkpoint in `path`: an embedding model (the bare decoder + sentence-
    transformers files) when num_labels is 0, else `*ForSequenceClassification` with num_labels labels."""
    import transformers

    os.makedirs(path, exist_ok=True)
    build_tokenizer(path, vocab_size=2000)
    vocab = len(transformers.AutoTokenizer.from_pretrained(path))
    config = bert_config(vocab) if arch == "bert" else _hf_config(arch, "tiny", vocab, {"pad_token_id": 0})
    if num_labels:
        config.num_labels = num_labels
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    _randomize(model, std=0.1, seed=seed)
    model.save_pretrained(path, safe_serialization=True)
    if not num_labels:
        write_sentence_transformers_files(path, config.hidden_size, pooling_mode, normalize)
    return path


def get_pooling_checkpoint(name: str) -> str:
    """Path of a cached pooling checkpoint (one of POOLING_CHECKPOINTS), built on first use."""
    if name not in POOLING_CHECKPOINTS:
        raise ValueError(f"name must be one of {sorted(POOLING_CHECKPOINTS)}, got {name!r}.")
    root = cache_dir()
    final = os.path.join(root, f"pooling-{CACHE_VERSION}-{name}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".build-{name}-", dir=root)
    try:
        build_pooling_checkpoint(tmp, **POOLING_CHECKPOINTS[name])
        try:
            os.rename(tmp, final)  # atomic; fails if another process won the race
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
