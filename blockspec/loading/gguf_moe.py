"""llama.cpp's mixture-of-experts layout in a GGUF, as HF names and config.json fields (used by loading/gguf_io.py).

llama.cpp stores a layer's experts stacked: ffn_gate_exps / ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I] (numpy
order), each quantized as one tensor, and the router as ffn_gate_inp [E, H]. The reader dequantizes a stacked bank
once and hands out one HF per-expert tensor per slice (`EXPERT_SLOT` in the name marks a stacked bank). The keys
`{arch}.expert_count`, `expert_used_count` and `expert_feed_forward_length` are llama.cpp's for every MoE
architecture; a file without them has no experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Container

from blockspec.errors import ModelLoadError

EXPERT_SLOT = "{expert}"  # in an HF name: the expert index of each slice of a stacked bank
# GGUF block tensor kind -> HF name within the layer (the router's is HF's `mlp.gate`)
MOE_BLK = {"ffn_gate_inp": "mlp.gate",
           "ffn_gate_exps": f"mlp.experts.{EXPERT_SLOT}.gate_proj",
           "ffn_up_exps": f"mlp.experts.{EXPERT_SLOT}.up_proj",
           "ffn_down_exps": f"mlp.experts.{EXPERT_SLOT}.down_proj"}


def check_bank(name: str, shape: tuple[int, ...], experts: int | None, path: Path) -> None:
    """A stacked bank must be [num_experts, out, in] ([num_experts, out] for its biases: gpt-oss)."""
    bias = name.endswith(".bias")
    if len(shape) != (2 if bias else 3) or shape[0] != experts:
        raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(shape)}; a stacked expert bank is "
                             f"[expert_count={experts}, out{'' if bias else ', in'}]")


def moe_config(meta: dict[str, Any], arch: str, tensors: Container[str], layers: int, path: Path) -> dict[str, Any]:
    """The HF config.json fields of the file's experts ({} for a dense file). Layers without a router
    (ffn_gate_inp) are dense: HF's mlp_only_layers. llama.cpp always renormalizes the top-k weights of qwen3moe
    (HF's norm_topk_prob), so that is the default where the file does not say."""
    if f"{arch}.expert_count" not in meta:
        return {}

    def need(key: str) -> int:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{path}: required GGUF metadata key {arch + '.' + key!r} is missing")
        return int(meta[f"{arch}.{key}"])

    if int(meta.get(f"{arch}.expert_shared_count", 0)):
        raise ModelLoadError(f"{path}: shared experts ({arch}.expert_shared_count) are not supported")
    return {
        "num_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }
