"""Quantize a random-weight checkpoint into AWQ (AutoAWQ GEMM) or GPTQ's exact on-disk layout, for tests.

What the tools write, and so what this writes:

* AutoAWQ (``version: gemm``, ``zero_point: true``): per linear layer ``qweight`` [K, N/8], ``qzeros``
  [K/G, N/8] (packed along N in AutoAWQ's interleaved nibble order), ``scales`` [K/G, N] float16, the bias
  if any; config.json's ``quantization_config`` {quant_method, bits, group_size, zero_point, version,
  modules_to_not_convert}. Scales/zeros are asymmetric min/max per group (AutoAWQ's round-to-nearest).
* GPTQ (AutoGPTQ / optimum, ``checkpoint_format: gptq``): ``qweight`` [K/8, N] packed along K,
  ``qzeros`` [G, N/8] holding zero - 1, ``scales`` [G, N] float16, ``g_idx`` [K] int32, the bias if any;
  config.json's ``quantization_config`` and a ``quantize_config.json`` beside it. sym=True uses zero
  2**(bits-1); desc_act=True visits input columns in a permuted order ("act order": here a seeded
  permutation shared by the projections that read the same input, as real act order is) and g_idx maps
  each column to its group. The rounding is plain round-to-nearest: GPTQ's Hessian updates change which
  integers are stored, not how they are laid out, and the layout is what a reader must get right.

Everything not quantized (embeddings, norms, LM head) is saved in float16, as the tools save it.
`dequantized_checkpoint` writes the float32 model that an int4 checkpoint stands for (each layer's
reference dequantization), which tests run beside the int4 one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

import torch

from vllm_lite.quantization.packing import (
    AWQ_ORDER,
    dequantize_awq,
    dequantize_gptq,
    pack_cols,
    pack_rows,
)

# Decoder linear layers the tools quantize (Llama/Mistral/Qwen2/Qwen3 names); the LM head stays float.
QUANTIZED = re.compile(r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))\.weight$")
MAXQ = 15


def _groups_min_max(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group of `group` consecutive columns) min and max of w [N, K] -> [N, K/group] each."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    return g.amin(-1), g.amax(-1)


def _quantize_rtn(
    w: torch.Tensor, group: int, sym: bool, min_zero: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of w [N, K] in groups along K -> (q [N, K], zeros [N, G] int, scales [N, G] fp16).

    The integers are computed against the float16 scales that get stored, so dequantizing what is
    written reproduces them exactly."""
    lo, hi = _groups_min_max(w, group)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)  # the range always holds 0 (both tools do this)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        scales = (2 * hi / MAXQ).clamp(min=1e-5)
        zeros = torch.full_like(scales, (MAXQ + 1) // 2, dtype=torch.int64)
    else:
        scales = ((hi - lo) / MAXQ).clamp(min=1e-5)
        zeros = torch.round(-lo / scales).clamp(min_zero, MAXQ).to(torch.int64)
    scales = scales.to(torch.float16)
    s = scales.float().repeat_interleave(group, dim=1)
    z = zeros.repeat_interleave(group, dim=1)
    q = (torch.round(w / s) + z).clamp(0, MAXQ).to(torch.int64)
    return q, zeros, scales


def quantize_awq(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """HF weight [N, K] -> AutoAWQ GEMM tensors {qweight, qzeros, scales}."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    q, zeros, scales = _quantize_rtn(w.float(), group, sym=False, min_zero=0)
    return {
        "qweight": pack_cols(q.t().contiguous(), AWQ_ORDER),
        "qzeros": pack_cols(zeros.t().contiguous(), AWQ_ORDER),
        "scales": scales.t().contiguous(),
    }


def quantize_gptq(
    w: torch.Tensor, group_size: int, sym: bool, perm: Optional[torch.Tensor], checkpoint_format: str = "gptq"
) -> dict[str, torch.Tensor]:
    """HF weight [N, K] -> GPTQ tensors {qweight, qzeros, scales, g_idx}; perm: act-order column order or None."""
    n, k = w.shape
    group = k if group_size == -1 else group_size
    order = torch.arange(k) if perm is None else perm
    # "gptq" stores zero - 1 in 4 bits: keep zeros >= 1 so every zero survives the round trip.
    min_zero = 1 if checkpoint_format == "gptq" else 0
    q_perm, zeros, scales = _quantize_rtn(w.float()[:, order], group, sym=sym, min_zero=min_zero)
    q = torch.empty_like(q_perm)
    q[:, order] = q_perm  # back to the original column order, as GPTQ saves qweight
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
    return {
        "qweight": pack_rows(q.t().contiguous()),
        "qzeros": pack_cols(stored_zeros.t().contiguous()),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx,
    }


def _input_key(module: str) -> str:
    """Projections reading the same activations share an act order: q/k/v, gate/up; o and down alone."""
    prefix, proj = module.rsplit(".", 1)
    return prefix + "." + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)


def quantization_config(
    method: str, group_size: int, desc_act: bool = False, sym: bool = True, checkpoint_format: str = "gptq"
) -> dict[str, Any]:
    """config.json's quantization_config as the tools write it."""
    if method == "awq":  # AutoAWQ's to_transformers_dict()
        return {
            "quant_method": "awq",
            "zero_point": True,
            "group_size": group_size,
            "bits": 4,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if method == "gptq":  # AutoGPTQ/optimum's BaseQuantizeConfig
        return {
            "bits": 4,
            "group_size": group_size,
            "damp_percent": 0.01,
            "desc_act": desc_act,
            "static_groups": False,
            "sym": sym,
            "true_sequential": True,
            "model_name_or_path": None,
            "model_file_base_name": "model",
            "quant_method": "gptq",
            "checkpoint_format": checkpoint_format,
        }
    raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}.")


def _copy_side_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f not in ("config.json", "model.safetensors.index.json"):
            path = os.path.join(src, f)
            if os.path.isfile(path):
                shutil.copy(path, os.path.join(dst, f))


def _read_all(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, f)))
    return out


def quantize_checkpoint(
    src: str,
    dst: str,
    method: str,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    seed: int = 0,
) -> str:
    """Write `src` (a float checkpoint) quantized with `method` ("awq" or "gptq") to `dst`; returns dst."""
    from safetensors.torch import save_file

    if method == "awq" and desc_act:
        raise ValueError("desc_act applies to GPTQ only; AWQ has no act order.")
    qc = quantization_config(method, group_size, desc_act, sym, checkpoint_format)
    tensors = _read_all(src)
    out: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        t = tensors[name]
        if not QUANTIZED.search(name):
            out[name] = t.to(torch.float16) if t.dtype.is_floating_point else t
            continue
        base = name[: -len(".weight")]
        if method == "awq":
            parts = quantize_awq(t, group_size)
        else:
            perm = None
            if desc_act:
                key = _input_key(base)
                if key not in perms:
                    perms[key] = torch.randperm(t.shape[1], generator=gen)
                perm = perms[key]
            parts = quantize_gptq(t, group_size, sym, perm, checkpoint_format)
        out.update({f"{base}.{k}": v for k, v in parts.items()})
    _copy_side_files(src, dst)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if method == "gptq":  # AutoGPTQ also writes its own file beside config.json
        with open(os.path.join(dst, "quantize_config.json"), "w") as f:
            json.dump({k: v for k, v in qc.items() if k != "quant_method"}, f, indent=2)
    return dst


def dequantize_checkpoint_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of an int4 checkpoint as float32, each quantized layer's `weight` [N, K] dequantized."""
    with open(os.path.join(model_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    tensors = _read_all(model_dir)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            if qc["quant_method"] == "awq":
                w = dequantize_awq(t, tensors[base + ".qzeros"], tensors[base + ".scales"], qc["group_size"])
            else:
                fmt = qc.get("checkpoint_format", "gptq")
                w = dequantize_gptq(
                    t, tensors[base + ".qzeros"], tensors[base + ".scales"], tensors[base + ".g_idx"], fmt
                )
            out[base + ".weight"] = w.t().contiguous()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            out[name] = t.float() if t.dtype.is_floating_point else t
    return out


def dequantized_checkpoint(model_dir: str, dst: str) -> str:
    """The float32 checkpoint an int4 one stands for (reference dequantization of every layer); returns dst."""
    from safetensors.torch import save_file

    _copy_side_files(model_dir, dst)
    for side in ("quantize_config.json", "quant_config.json"):
        if os.path.exists(os.path.join(dst, side)):
            os.remove(os.path.join(dst, side))
    save_file(
        dequantize_checkpoint_tensors(model_dir), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"}
    )
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def get_quantized_checkpoint(
    arch: str,
    method: str,
    group_size: int = 32,
    desc_act: bool = False,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    size: str = "tiny",
) -> str:
    """The cached test checkpoint (arch, size) quantized with these settings, built on first use."""
    from vllm_lite.testing.checkpoints import CACHE_VERSION, cached_build, get_checkpoint

    src = get_checkpoint(arch, size)
    name = f"{CACHE_VERSION}-int4-{arch}-{size}-{method}-g{group_size}"
    if method == "gptq":
        name += f"-{'act' if desc_act else 'seq'}-{'sym' if sym else 'asym'}-{checkpoint_format}"
    return cached_build(
        name,
        lambda tmp: quantize_checkpoint(src, tmp, method, group_size, desc_act, sym, checkpoint_format),
    )


def get_dequantized_checkpoint(quantized: str) -> str:
    """The cached float32 checkpoint that the int4 checkpoint at `quantized` stands for."""
    from vllm_lite.testing.checkpoints import cached_build

    return cached_build(
        os.path.basename(quantized.rstrip("/")) + "-dequantized", lambda tmp: dequantized_checkpoint(quantized, tmp)
    )
