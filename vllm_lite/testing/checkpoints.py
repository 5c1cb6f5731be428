"""Random-weight Hugging Face checkpoints built locally, for tests and benchmarks.

Nothing here downloads anything: the tokenizer is trained on text that ships
with Python, and the weights are random (scaled so greedy decoding is not
degenerate). `get_checkpoint` builds each (arch, size) once into a cache dir
and reuses it; concurrent builders race safely (build in a temp dir, rename).
"""

from __future__ import annotations

import glob
import os
import shutil
import sysconfig
import tempfile
from typing import Any, Callable, Optional

import torch

from vllm_lite import envs

CACHE_VERSION = "v1"
ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "opt",
    "phi3",
    "gpt2",
    "gemma2",
    "mistral_sw",
    "qwen2_sw",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "phi3_longrope",
)
# Sliding window of the *_sw and gemma2 builds: small, so test prompts run past it.
TINY_WINDOW = 24
SIZES = ("tiny", "100m", "moe-small")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|endoftext|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def _corpus(large: bool) -> list[str]:
    """Training text that is always present: pydoc topics, plus stdlib sources for a big vocab."""
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    if large:
        total = 0
        for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
            total += len(texts[-1])
            if total > 6_000_000:
                break
    return texts


def build_tokenizer(path: str, vocab_size: int = 2000) -> str:
    """Train a byte-level BPE tokenizer and save it so AutoTokenizer loads it (fast); returns path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be at least 300 (256 bytes + specials), got {vocab_size}.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(large=vocab_size > 8000), trainer)
    # Prompts start with <s>, like Llama's tokenizer.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=1 << 20
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def _tiny_kwargs(arch: str, vocab: int) -> dict[str, Any]:
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=1024,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch == "gpt2":
        return dict(
            vocab_size=vocab,
            n_embd=64,
            n_layer=3,
            n_head=4,
            n_positions=1024,
            n_inner=None,
            activation_function="gelu_new",
            tie_word_embeddings=True,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
    if arch == "opt":
        # Projected embeddings (word_embed_proj_dim != hidden) exercise project_in/out.
        return dict(common, ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=True, tie_word_embeddings=True)
    common.update(num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-6)
    if arch == "llama":
        return dict(common, tie_word_embeddings=False, head_dim=16)
    if arch == "mistral":
        return dict(common, tie_word_embeddings=False, head_dim=16, sliding_window=None)
    if arch == "qwen2":
        return dict(common, tie_word_embeddings=True, rope_theta=100000.0, use_sliding_window=False)
    if arch == "mistral_sw":  # every layer windowed: the KV manager frees blocks behind the window
        return dict(common, tie_word_embeddings=False, head_dim=16, sliding_window=TINY_WINDOW)
    if arch == "qwen2_sw":  # Qwen2's rule: layers >= max_window_layers windowed (here 1 and 2)
        return dict(
            common,
            tie_word_embeddings=True,
            rope_theta=100000.0,
            use_sliding_window=True,
            sliding_window=TINY_WINDOW,
            max_window_layers=1,
        )
    if arch == "phi3":  # Phi-4-mini-like: partial rotary, GQA; fused qkv/gate_up in the checkpoint
        return dict(
            common,
            tie_word_embeddings=False,
            partial_rotary_factor=0.5,
            sliding_window=None,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        )
    if arch == "phi3_longrope":  # Phi-3-128k-like LongRoPE, original context 32 so test prompts cross it
        return dict(
            _tiny_kwargs("phi3", vocab),
            original_max_position_embeddings=32,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.3, 2.1, 3.7],
                "long_factor": [1.5, 2.9, 7.3, 16.0],
            },
        )
    if arch == "gemma2":  # Gemma-2-2b-like: head_dim != hidden/heads, query_pre_attn_scalar != head_dim
        # Soft caps scaled down with the weights so both actually bind on random tiny activations.
        return dict(
            common,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=TINY_WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        )
    if arch == "gemma3":  # Gemma-3-1b-like: global every 3rd layer, local/global rope bases, q/k norm, no caps
        return dict(
            common,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=TINY_WINDOW,
            sliding_window_pattern=3,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        )
    if arch == "mixtral":  # Mixtral-8x7B scaled down: 4 experts, top-2
        return dict(
            common,
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
    if arch == "qwen3_moe":  # Qwen3-30B-A3B scaled down: 4 experts top-2, renormalised; layer 1 dense
        return dict(
            common,
            tie_word_embeddings=False,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            use_sliding_window=False,
        )
    if arch == "qwen3":
        # head_dim given explicitly and different from hidden / heads, as in real Qwen3 configs.
        return dict(common, tie_word_embeddings=False, head_dim=32)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}.")


def _hf_config(arch: str, size: str, vocab: int, overrides: Optional[dict[str, Any]]):
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
        "mistral": (transformers.MistralConfig, "MistralForCausalLM"),
        "qwen2": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
        "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM"),
        "opt": (transformers.OPTConfig, "OPTForCausalLM"),
        "phi3": (transformers.Phi3Config, "Phi3ForCausalLM"),
        "phi3_longrope": (transformers.Phi3Config, "Phi3ForCausalLM"),
        "gpt2": (transformers.GPT2Config, "GPT2LMHeadModel"),
        "gemma2": (transformers.Gemma2Config, "Gemma2ForCausalLM"),
        "mistral_sw": (transformers.MistralConfig, "MistralForCausalLM"),
        "qwen2_sw": (transformers.Qwen2Config, "Qwen2ForCausalLM"),
        "gemma3": (transformers.Gemma3TextConfig, "Gemma3ForCausalLM"),
        "mixtral": (transformers.MixtralConfig, "MixtralForCausalLM"),
        "qwen3_moe": (transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}.")
    if size == "tiny":
        kwargs = _tiny_kwargs(arch, vocab)
    elif size == "100m":
        if arch != "qwen2":
            raise ValueError(f"size '100m' is Qwen2-shaped: use arch='qwen2', got {arch!r}.")
        kwargs = dict(
            vocab_size=vocab,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=3072,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
    elif size == "moe-small":
        if arch != "mixtral":
            raise ValueError(f"size 'moe-small' is Mixtral-shaped: use arch='mixtral', got {arch!r}.")
        # Mixtral-8x7B's layout (8 experts, top-2, GQA 4:1) at ~25M parameters (~8M active per token).
        kwargs = dict(
            _tiny_kwargs("mixtral", vocab),
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=896,
            num_local_experts=8,
            max_position_embeddings=4096,
            rope_theta=1_000_000.0,
        )
    else:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}.")
    kwargs.update(overrides or {})
    cls, arch_name = classes[arch]
    return cls(architectures=[arch_name], **kwargs)


@torch.no_grad()
def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Every parameter random (norm gains near 1, biases small) so no code path hides behind an identity."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if p.dim() == 1 and name.endswith("weight"):  # norm gains
            p.copy_(1.0 + 0.2 * noise)
        elif p.dim() == 1:  # biases
            p.copy_(0.1 * noise)
        else:
            p.copy_(std * noise)


def build_checkpoint(
    arch: str,
    path: str,
    size: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    config_overrides: Optional[dict[str, Any]] = None,
    max_shard_size: Optional[str] = None,
) -> str:
    """Write a random-weight checkpoint (config.json, safetensors, tokenizer) for `arch` to path; returns path.

    config_overrides tweaks the transformers config (e.g. rope_scaling, do_layer_norm_before);
    max_shard_size (e.g. "200KB") writes a sharded checkpoint with an index.
    """
    import transformers

    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype!r}.")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}.")
    os.makedirs(path, exist_ok=True)
    build_tokenizer(path, vocab_size={"tiny": 2000, "moe-small": 8000}.get(size, 32000))
    vocab = len(transformers.AutoTokenizer.from_pretrained(path))
    config = _hf_config(arch, size, vocab, config_overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, std={"tiny": 0.1, "moe-small": 0.05}.get(size, 0.02), seed=seed)
    model = model.to(dtype)
    model.config.dtype = dtype
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def cache_dir() -> str:
    return envs.VLLM_LITE_TEST_CACHE or os.path.join(os.path.expanduser("~"), ".cache", "vllm_lite_test")


def get_checkpoint(arch: str, size: str = "tiny") -> str:
    """Path of a cached checkpoint for (arch, size), built on first use; safe under concurrent callers."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}.")
    dtype = torch.bfloat16 if size == "100m" else torch.float32
    return cached_build(
        f"{CACHE_VERSION}-{arch}-{size}", lambda tmp: build_checkpoint(arch, tmp, size=size, dtype=dtype)
    )


def cached_build(name: str, build: Callable[[str], object]) -> str:
    """``cache_dir()/name``, made by ``build(tmp_dir)`` on first use and renamed into place atomically."""
    root = cache_dir()
    final = os.path.join(root, name)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".build-{name}-", dir=root)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)  # atomic; fails if another process won the race
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
