"""Where a model named by the user lives on disk, as vLLM resolves it.

A local directory is used as is. Anything else is a Hugging Face repo id: it is looked up
in the Hugging Face cache (``HF_HOME``/``HF_HUB_CACHE``, or ``download_dir``) through
``huggingface_hub``; with ``HF_HUB_OFFLINE=1`` only the cache is read, otherwise missing
files are downloaded. Either way the engine then reads plain files from one directory.
"""

from __future__ import annotations

import os
from typing import Optional, Protocol

from vllm_lite import envs

# What the engine reads from a checkpoint: configs, weights, tokenizer files, chat templates.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def looks_like_local_path(name: str) -> bool:
    """A name that can only mean a path (absolute, relative with ./ or ~, or more than one '/')."""
    return (
        os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)
    )


def resolve_model_dir(
    name: str,
    *,
    revision: Optional[str] = None,
    download_dir: Optional[str] = None,
    what: str = "model",
) -> str:
    """A local directory holding `name`'s files; FileNotFoundError saying where it looked otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a local directory or a Hugging Face repo id, got {name!r}.")
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if revision is not None:
            raise ValueError(f"{what}={name!r} is a local directory; revision={revision!r} applies to repo ids only.")
        return expanded
    if os.path.exists(expanded):
        raise FileNotFoundError(f"{what}={name!r} is a file, not a checkpoint directory.")
    if looks_like_local_path(name):
        raise FileNotFoundError(f"{what} directory {name!r} does not exist.")
    return _from_hub(name, revision, download_dir, what)


def _from_hub(repo_id: str, revision: Optional[str], download_dir: Optional[str], what: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = envs.HF_HUB_OFFLINE
    where = download_dir or "the Hugging Face cache (HF_HOME / HF_HUB_CACHE)"
    try:
        return snapshot_download(
            repo_id=repo_id,
            revision=revision,
            cache_dir=download_dir,
            local_files_only=offline,
            allow_patterns=_ALLOW_PATTERNS,
        )
    except HFValidationError as e:
        raise FileNotFoundError(
            f"{what}={repo_id!r} is neither a local directory nor a valid Hugging Face repo id ({e})."
        ) from None
    except LocalEntryNotFoundError:
        rev = f" at revision {revision!r}" if revision else ""
        hint = "HF_HUB_OFFLINE=1 forbids downloading" if offline else "and it could not be downloaded"
        raise FileNotFoundError(
            f"{what}={repo_id!r}{rev} is not a local directory and is not in {where}; {hint}."
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{what}={repo_id!r}: no such repository on the Hugging Face hub.") from None


def check_model_options(trust_remote_code: bool, quantization: Optional[str], max_logprobs: int) -> None:
    """Refuse, with the reason, the model options vLLM accepts that this engine cannot honour."""
    if trust_remote_code:
        raise ValueError(
            "trust_remote_code=True: vllm-lite runs no code from checkpoints, only its own model "
            "implementations (Llama, Mistral, Qwen2, Qwen3, OPT, ...); leave trust_remote_code off."
        )
    # `quantization` is checked against the checkpoint by quantization.quant_config.resolve_quantization.
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < 0:
        raise ValueError(f"max_logprobs must be a non-negative integer, got {max_logprobs!r}.")


def resolve_model_and_tokenizer(args: "_ModelArgs") -> tuple[str, str, Optional[str]]:
    """(model dir, tokenizer dir, generation-config dir or None) for EngineArgs-like `args`.

    generation_config follows vLLM: "auto" reads the model's own generation_config.json,
    "vllm" uses none (vLLM's defaults), anything else is a directory that holds one.
    """
    model_dir = resolve_model_dir(args.model, revision=args.revision, download_dir=args.download_dir)
    if args.tokenizer is None and args.tokenizer_revision in (None, args.revision):
        tokenizer_dir = model_dir
    else:
        tokenizer_dir = resolve_model_dir(
            args.tokenizer or args.model,
            revision=args.tokenizer_revision,
            download_dir=args.download_dir,
            what="tokenizer",
        )
    gen = args.generation_config
    if gen == "auto":
        gen_dir: Optional[str] = model_dir
    elif gen == "vllm":
        gen_dir = None
    else:
        gen_dir = os.path.expanduser(gen)
        if not os.path.isfile(os.path.join(gen_dir, "generation_config.json")):
            raise FileNotFoundError(
                f"generation_config={gen!r}: expected 'auto', 'vllm' or a directory with a generation_config.json."
            )
    return model_dir, tokenizer_dir, gen_dir


class _ModelArgs(Protocol):
    """The EngineArgs fields read above (config.py imports this module, not the reverse)."""

    model: str
    tokenizer: Optional[str]
    revision: Optional[str]
    tokenizer_revision: Optional[str]
    download_dir: Optional[str]
    generation_config: str
