"""Map Hugging Face checkpoint tensor names onto a model's (possibly fused) parameters."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from torch import nn

from vllm_lite.worker.models.layers import default_weight_loader

# (our fused param fragment, HF fragment, shard id)
StackedMapping = Sequence[tuple[str, str, object]]


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Any]],
    stacked: StackedMapping = (),
    skip_suffixes: Sequence[str] = ("rotary_emb.inv_freq",),
    tied_names: Sequence[str] = (),
) -> set[str]:
    """Copy each (hf_name, tensor) into its parameter; returns the names of the parameters written.

    A tensor may be a lazy safetensors slice: modules with a `load_weight`
    (tensor-parallel ones) or a `weight_loader` read only this rank's shard.

    `stacked` routes e.g. ".q_proj." into ".qkv_proj." shard "q". Names in
    `tied_names` (lm_head.weight when embeddings are tied) are accepted and
    ignored. Any other unknown name raises ValueError: a checkpoint that does
    not match the architecture must fail loudly, not half-load.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shards_seen: dict[str, set[object]] = {}
    for name, tensor in weights:
        if name.endswith(tuple(skip_suffixes)) or name in tied_names:
            continue
        for fused, hf, shard_id in stacked:
            if hf in name:
                target = name.replace(hf, fused)
                if target not in params:
                    raise ValueError(f"unexpected checkpoint weight {name!r}: the model has no parameter {target!r}.")
                owner = model.get_submodule(target.rsplit(".", 1)[0])
                owner.weight_loader(params[target], tensor, shard_id)
                shards_seen.setdefault(target, set()).add(shard_id)
                break
        else:
            if name not in params:
                raise ValueError(
                    f"unexpected checkpoint weight {name!r} (no such parameter in {type(model).__name__})."
                )
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            # Sharded modules (row/column-parallel, vocab-parallel) read only their rank's part.
            getattr(owner, "load_weight", default_weight_loader)(params[name], tensor)
            loaded.add(name)
    # A fused parameter counts as loaded only once every one of its shards arrived.
    for target, seen in shards_seen.items():
        if seen >= set(model.get_submodule(target.rsplit(".", 1)[0]).shards):
            loaded.add(target)
    return loaded
