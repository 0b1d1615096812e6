"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B, ...): Qwen3's attention (per-head q/k
RMSNorm) with, in the sparse layers, top-k routed experts in place of the dense MLP: softmax routing over
`num_experts`, the `num_experts_per_tok` largest renormalized when `norm_topk_prob`, no shared expert, each expert a
SwiGLU MLP of `moe_intermediate_size`. A layer is sparse unless it is listed in `mlp_only_layers`, and when
(layer + 1) is a multiple of `decoder_sparse_step`, as in HF's Qwen3MoeDecoderLayer; the others keep a dense MLP of
`intermediate_size`. The routed-experts kernel is layers/moe.py (docs/moe.md).

Checkpoints: HF's per-expert names (`mlp.gate.weight`, `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, what
the hub holds and what transformers 5 writes back) load as they stand; transformers 5's in-memory stacked banks
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) are split per expert here
(`checkpoint_tensors`); llama.cpp's stacked `ffn_*_exps` are split by loading/gguf_io.py."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.layers.moe import SparseMoeBlock
from blockspec.models.base import packed_shard_sizes
from blockspec.models.config import ModelConfig
from blockspec.models.decoder import MLP, DecoderForCausalLM, DecoderLayer, LayerTraits

# transformers 5's stacked expert banks: (prefix)mlp.experts.gate_up_proj | down_proj, no ".weight"
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts fields of a Qwen3-MoE config.json, checked: a bad value fails in one line naming the
    field and the value, before any weight is allocated."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, each expert's
    norm_topk_prob: bool
    sparse_layers: frozenset[int]

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "MoeSpec":
        src, raw = cfg.source, cfg.raw
        # transformers 5 writes num_local_experts (num_experts is an alias of it there); the hub's configs num_experts
        if raw.get("num_experts") is not None and raw.get("num_local_experts") is not None \
                and raw["num_experts"] != raw["num_local_experts"]:
            raise ModelLoadError(f"{src}: fields 'num_experts'={raw['num_experts']!r} and 'num_local_experts'="
                                 f"{raw['num_local_experts']!r} disagree")
        key = "num_local_experts" if raw.get("num_experts") is None and raw.get("num_local_experts") is not None \
            else "num_experts"  # named in the errors: the field the file has (num_experts where it has neither)
        experts = cfg.integer(key, minimum=1)
        top_k = cfg.integer("num_experts_per_tok", minimum=1)
        if top_k > experts:
            raise ModelLoadError(f"{src}: field 'num_experts_per_tok' must be at most {key}={experts}, got {top_k}")
        inter = cfg.integer("moe_intermediate_size", minimum=1)
        step = cfg.integer("decoder_sparse_step", default=1, minimum=1)
        dense = raw.get("mlp_only_layers") or []
        n = cfg.num_hidden_layers
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                                  for i in dense):
            raise ModelLoadError(f"{src}: field 'mlp_only_layers' must list layer indices below "
                                 f"num_hidden_layers={n}, got {dense!r}")
        act = raw.get("hidden_act") or "silu"
        if act != "silu":
            raise ModelLoadError(f"{src}: field 'hidden_act' must be 'silu' for {cfg.architecture}, got {act!r}")
        if cfg.flag("use_sliding_window"):
            raise ModelLoadError(f"{src}: field 'use_sliding_window' is true; sliding-window attention is not "
                                 f"supported for {cfg.architecture}")
        sparse = frozenset(i for i in range(n) if i not in dense and (i + 1) % step == 0)
        return cls(experts, top_k, inter, cfg.flag("norm_topk_prob"), sparse)


class Qwen3MoeDecoderLayer(DecoderLayer):
    """A sparse layer: the shared attention, routed experts for the MLP. A class of its own (not a DecoderLayer with
    another mlp) so that code which handles only the shared dense layer (the native q4 layer stack) can tell."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, traits: LayerTraits, moe: MoeSpec) -> None:
        expert_cfg = dataclasses.replace(cfg, intermediate_size=moe.intermediate_size)
        experts = nn.ModuleList(MLP(expert_cfg) for _ in range(moe.num_experts))
        super().__init__(cfg, layer_idx, traits,
                         mlp=SparseMoeBlock(cfg.hidden_size, experts, moe.top_k, moe.norm_topk_prob))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    gguf_architecture = "qwen3moe"

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        # Qwen3's attention: q/k norm always; attention_bias biases q, k, v and o alike
        bias = cfg.flag("attention_bias")
        return LayerTraits(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def __init__(self, cfg: ModelConfig) -> None:
        # read before the stack is built (make_layer reads it): a plain attribute, which nn.Module lets through
        self.moe = MoeSpec.from_config(cfg)
        super().__init__(cfg)

    def make_layer(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if layer_idx not in self.moe.sparse_layers:
            return DecoderLayer(cfg, layer_idx, self.traits)
        return Qwen3MoeDecoderLayer(cfg, layer_idx, self.traits, self.moe)

    def shard_sizes(self, param: str) -> list[int]:
        if ".experts." in param:  # an expert's packed gate|up
            return [self.moe.intermediate_size, self.moe.intermediate_size]
        return packed_shard_sizes(self.config, param)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """transformers 5's stacked banks split into HF's per-expert names (gate|up halves apart, so the loader packs
        and checks them as any gate_proj / up_proj); every other tensor as it is."""
        for name, t in tensors:
            m = _STACKED.fullmatch(name)
            if m is None:
                yield name, t
                continue
            if t.dim() != 3:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}; a stacked expert bank is "
                                     f"[num_experts, out, in]")
            prefix, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
