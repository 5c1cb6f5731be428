"""Which runner a checkpoint gets, and how a pooling model pools: vLLM's `PoolerConfig` and `--runner`.

The pooler's defaults come, in order, from the user's `pooler_config`, the checkpoint's
sentence-transformers files (`modules.json`, `1_Pooling/config.json`, a `Normalize` module),
and the architecture (decoders pool their LAST token, encoders their CLS token). `runner="auto"`
picks "pooling" for architectures with no LM head (`BertModel`, `Qwen3Model`, `*ForSequenceClassification`)
and for sentence-transformers checkpoints, else "generate". Read once, at engine configuration.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Sequence

from vllm_lite.config_values import config_fields

RUNNERS = ("auto", "generate", "pooling")
# vLLM's --convert: serve a generative (*ForCausalLM) checkpoint as a pooling model of this kind.
CONVERTS = ("auto", "none", "embed", "classify", "reward")
# convert -> the architecture suffix a converted *ForCausalLM becomes (its class: the decoder with no LM head,
# plus a `score` head for classify).
_CONVERTED_SUFFIX = {"embed": "Model", "classify": "ForSequenceClassification", "reward": "ForRewardModel"}
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
# sentence-transformers' pooling modes -> ours (max / weighted modes have no counterpart: refused).
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_LEGACY_KEYS = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_LEGACY_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
# Architecture suffixes that mean a pooling model (no LM head to generate with).
_POOLING_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForRewardModel", "ForRewardModeling")
_GENERATE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_ENCODER_PREFIXES = ("Bert", "Roberta", "XLMRoberta", "DistilBert", "Electra", "ModernBert")


@dataclass
class PoolerConfig:
    """How a pooling model pools (vLLM's `--pooler-config`); None fields: the checkpoint's default."""

    pooling_type: Optional[str] = None  # LAST, MEAN, CLS or ALL (every token's hidden state)
    normalize: Optional[bool] = None  # L2-normalise embeddings
    dimensions: Optional[int] = None  # Matryoshka: default number of dimensions kept
    activation: Optional[bool] = None  # classifier outputs through softmax/sigmoid
    softmax: Optional[bool] = None  # vLLM's older name for activation (reward models)

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(
                    f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}."
                )
            self.pooling_type = self.pooling_type.upper()
        for name in ("normalize", "activation", "softmax"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"pooler_config.{name} must be a bool, got {v!r}.")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"pooler_config.dimensions must be a positive integer, got {d!r}.")

    @classmethod
    def from_value(cls, value: Any) -> Optional["PoolerConfig"]:
        """From a PoolerConfig, a dict or its JSON text (None stays None); unknown keys are a ValueError."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**config_fields(value, "pooler_config", (f.name for f in fields(cls))))

    def merged_over(self, base: "PoolerConfig") -> "PoolerConfig":
        """This config's set fields over `base`'s."""
        mine = {k: v for k, v in asdict(self).items() if v is not None}
        return PoolerConfig(**{**asdict(base), **mine})


def is_encoder_architecture(archs: Sequence[str]) -> bool:
    """Bidirectional encoders (BERT family): their whole prompt must run in one step."""
    return any(a.startswith(_ENCODER_PREFIXES) for a in archs)


def is_classifier_architecture(archs: Sequence[str]) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in archs)


def is_pooling_architecture(archs: Sequence[str]) -> bool:
    """An architecture with no LM head: `*Model` (BertModel, Qwen3Model) or a classifier/reward head."""
    for a in archs:
        if a.endswith(_GENERATE_SUFFIXES):
            return False
        if a.endswith(_POOLING_SUFFIXES) or a.endswith("Model"):
            return True
    return False


def is_reward_architecture(archs: Sequence[str]) -> bool:
    return any(a.endswith(("ForRewardModel", "ForRewardModeling")) for a in archs)


def resolve_runner(runner: str, archs: Sequence[str], model_dir: str, convert: str = "auto") -> str:
    """'generate' or 'pooling' for `runner` ('auto' decides from `convert`, the architecture and the ST files)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}.")
    if runner == "generate" and convert not in ("auto", "none"):
        raise ValueError(
            f"convert={convert!r} turns a model into a pooling model; it cannot be used with runner='generate' "
            "(use runner='pooling' or 'auto')."
        )
    if runner != "auto":
        return runner
    if convert in _CONVERTED_SUFFIX:
        return "pooling"
    if is_pooling_architecture(archs) or read_sentence_transformers_modules(model_dir):
        return "pooling"
    return "generate"


def resolve_convert(convert: str, runner_type: str, archs: Sequence[str]) -> tuple[str, list[str]]:
    """vLLM's convert type for a resolved runner, and the architectures the model is built as.

    'auto' on the pooling runner converts a generative architecture to 'embed' ('classify' / 'reward' when its
    name says so) and leaves native pooling architectures as they are ('none'). A converted `XForCausalLM` is
    built as `XModel` (embed), `XForSequenceClassification` (classify: a `score` head, whose weights the
    checkpoint must hold) or `XForRewardModel` (reward: every token's hidden state, as vLLM's ALL pooling).
    """
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}.")
    if runner_type != "pooling":
        return "none", list(archs)
    native = is_pooling_architecture(archs)
    if convert == "auto":
        if native:
            return "none", list(archs)
        convert = "embed"
    if convert == "none":
        if not native:
            raise ValueError(
                f"convert='none': {archs[0]} is a generative architecture, not a pooling model; pass convert='embed', "
                "'classify' or 'reward' (or convert='auto') to serve it with runner='pooling'."
            )
        return "none", list(archs)
    if native:
        if convert == "classify" and not is_classifier_architecture(archs):
            raise ValueError(f"convert='classify': {archs[0]} has no classification head to classify with.")
        return convert, list(archs)
    generative = [a for a in archs if a.endswith("ForCausalLM")]
    if not generative:
        raise ValueError(f"convert={convert!r} converts *ForCausalLM architectures; got {', '.join(archs)}.")
    return convert, [a[: -len("ForCausalLM")] + _CONVERTED_SUFFIX[convert] for a in generative]


def read_sentence_transformers_modules(model_dir: str) -> list[dict[str, Any]]:
    """The checkpoint's modules.json entries ([] when it is not a sentence-transformers checkpoint)."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        modules = json.load(f)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: expected a list of module entries.")
    return modules


def _class_name(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def read_sentence_transformers_pooler(model_dir: str) -> PoolerConfig:
    """Pooling type and normalisation as the checkpoint's sentence-transformers files say (empty if none)."""
    modules = read_sentence_transformers_modules(model_dir)
    out = PoolerConfig()
    for m in modules:
        name = _class_name(m)
        if name == "Normalize":
            out.normalize = True
        elif name == "Pooling":
            out.pooling_type = _st_pooling_type(os.path.join(model_dir, str(m.get("path", "")), "config.json"))
        elif name == "Dense":
            raise ValueError(
                f"{model_dir}: the sentence-transformers Dense module ({m.get('path')}) is not supported; "
                "only Transformer, Pooling and Normalize modules are."
            )
    if modules and out.normalize is None:
        out.normalize = False  # a sentence-transformers model without a Normalize module returns raw vectors
    return out


def _st_pooling_type(path: str) -> Optional[str]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt=false (instruction-excluded pooling) is not supported.")
    mode = cfg.get("pooling_mode")
    if mode is None:  # sentence-transformers before 6 wrote one boolean per mode
        for key in _ST_LEGACY_UNSUPPORTED:
            if cfg.get(key):
                raise ValueError(f"{path}: {key} is not supported (LAST, MEAN and CLS pooling are).")
        on = [ours for key, ours in _ST_LEGACY_KEYS.items() if cfg.get(key)]
        if len(on) > 1:
            raise ValueError(f"{path}: several pooling modes at once are not supported, got {on}.")
        return on[0] if on else None
    if isinstance(mode, list):
        if len(mode) != 1:
            raise ValueError(f"{path}: several pooling modes at once are not supported, got {mode}.")
        mode = mode[0]
    if mode not in _ST_MODES:
        raise ValueError(f"{path}: pooling_mode {mode!r} is not supported (lasttoken, mean and cls are).")
    return _ST_MODES[mode]


def resolve_pooler_config(user: Optional[PoolerConfig], archs: Sequence[str], model_dir: str) -> PoolerConfig:
    """Every field decided: the user's choices over the checkpoint's ST files over the architecture's defaults."""
    default = PoolerConfig(
        pooling_type="CLS" if is_encoder_architecture(archs) else "LAST",
        normalize=not is_classifier_architecture(archs),
        activation=True,
    )
    if is_reward_architecture(archs):  # vLLM's reward default: every token's hidden state, as it is
        default = PoolerConfig(pooling_type="ALL", normalize=False, activation=False)
    resolved = read_sentence_transformers_pooler(model_dir).merged_over(default)
    if user is not None:
        resolved = user.merged_over(resolved)
    if resolved.softmax is not None and user is not None and user.activation is None:
        resolved.activation = resolved.softmax
    return resolved
