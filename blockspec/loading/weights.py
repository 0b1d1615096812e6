"""Copy HF-named tensors into our modules: strip prefixes, pack q/k/v and gate/up, check every shape."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.loading.mxfp4 import dequantized

# Tensors some checkpoints carry that have no parameter here (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@torch.no_grad()
def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str, prefix: str = "model.") -> None:
    """Load `tensors` (HF names) into `model`. `model.packed` maps HF projection names to (fused name, shard index);
    `model.shard_sizes(param)` gives the row split of a fused parameter."""
    tensors = dequantized(tensors, source)  # MXFP4 `*_blocks` + `*_scales` pairs -> the dense tensor (gpt-oss)
    split = getattr(model, "checkpoint_tensors", None)  # a target family's own tensor layouts (drafters have none)
    if split is not None:
        tensors = split(tensors)
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, int]] = getattr(model, "packed", {})
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        name = hf_name[len(prefix):] if prefix and hf_name.startswith(prefix) else hf_name
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        shard = None
        for hf_part, (ours, idx) in packed.items():
            if f".{hf_part}." in f".{name}":
                name, shard = name.replace(hf_part, ours), idx
                break
        if name not in params:
            raise ModelLoadError(f"{source}: unexpected tensor {hf_name!r} (no such parameter in {type(model).__name__})")
        param = params[name]
        target = param.data
        if shard is not None:
            sizes = model.shard_sizes(name)  # type: ignore[operator]
            start = sum(sizes[:shard])
            target = target.narrow(0, start, sizes[shard])
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)} but the model config expects "
                f"{tuple(target.shape)}"
            )
        target.copy_(tensor.to(dtype=target.dtype))
        loaded.add(name if shard is None else f"{name}#{shard}")
    expected: set[str] = set()
    for name in params:
        if name.rsplit(".", 2)[-2] in {p for p, _ in packed.values()}:
            n = len(model.shard_sizes(name))  # type: ignore[operator]
            expected.update(f"{name}#{i}" for i in range(n))
        else:
            expected.add(name)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
        loaded.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        unpacked = {v: k for k, v in packed.items()}  # (fused name, shard index) -> HF projection name

        def hf_name_of(m: str) -> str:  # "layers.0.self_attn.qkv_proj.weight#1" -> "layers.0.self_attn.k_proj.weight"
            if "#" not in m:
                return m
            name, idx = m.split("#")
            head, fused, tail = name.rsplit(".", 2)
            hf_part = unpacked.get((fused, int(idx)))
            return f"{head}.{hf_part}.{tail}" if hf_part else f"{name} shard {idx}"

        shown = ", ".join(hf_name_of(m) for m in missing[:8])
        raise ModelLoadError(f"{source}: missing {len(missing)} tensor(s) the model needs: {shown}")
