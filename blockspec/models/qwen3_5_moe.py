"""The Qwen3.5 / Qwen3.6 hybrid family with routed experts (Qwen3_5MoeForCausalLM, e.g. Qwen3.5-35B-A3B): the
layers of models/qwen3_5.py with, in every layer, Qwen3-MoE's routed experts (layers/moe.py: softmax top-k over
`num_experts`, always renormalized) plus a shared expert (a SwiGLU MLP of shared_expert_intermediate_size) whose
output is scaled by sigmoid(shared_expert_gate(x)) and added.

Checkpoints: HF's per-expert names (`mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`) as they stand,
transformers 5's stacked banks split per expert as for Qwen3-MoE; the ConditionalGeneration form as for the dense
family."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.layers.moe import Router, SparseMoeBlock
from blockspec.models.config import ModelConfig
from blockspec.models.decoder import MLP
from blockspec.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from blockspec.models.qwen3_moe import Qwen3MoeForCausalLM


@dataclass(frozen=True)
class SharedMoeSpec:
    """The expert fields of a Qwen3.5-MoE config.json, checked, naming the field at fault."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, each routed expert's
    shared_intermediate_size: int  # shared_expert_intermediate_size

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> SharedMoeSpec:
        experts = cfg.integer("num_experts", minimum=1)
        top_k = cfg.integer("num_experts_per_tok", minimum=1)
        if top_k > experts:
            raise ModelLoadError(f"{cfg.source}: field 'num_experts_per_tok' must be at most num_experts={experts}, "
                                 f"got {top_k}")
        return cls(experts, top_k, cfg.integer("moe_intermediate_size", minimum=1),
                   cfg.integer("shared_expert_intermediate_size", minimum=1))


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts (the parent: `gate`, `experts.{e}`) + `shared_expert` gated by `shared_expert_gate`."""

    def __init__(self, cfg: ModelConfig, spec: SharedMoeSpec) -> None:
        expert_cfg = dataclasses.replace(cfg, intermediate_size=spec.intermediate_size)
        super().__init__(cfg.hidden_size, nn.ModuleList(MLP(expert_cfg) for _ in range(spec.num_experts)), spec.top_k,
                         norm_topk_prob=True)
        self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=spec.shared_intermediate_size))
        # one output row: a Router, not an nn.Linear, so the platform passes leave it unquantized and unpacked (as
        # the router: a quantized gate would move every row's shared-expert weight; quantized kernels take N >= 8)
        self.shared_expert_gate = Router(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        self.moe = SharedMoeSpec.from_config(cfg)  # read by make_mlp, before the stack is built
        super().__init__(cfg)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return SharedExpertMoeBlock(cfg, self.moe)

    def shard_sizes(self, param: str) -> list[int]:
        if ".experts." in param:
            return [self.moe.intermediate_size] * 2
        if ".shared_expert." in param:
            return [self.moe.shared_intermediate_size] * 2
        return super().shard_sizes(param)

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        # the language model's names first, then stacked expert banks split as Qwen3-MoE's
        return Qwen3MoeForCausalLM.checkpoint_tensors(self, super().checkpoint_tensors(tensors))  # type: ignore[arg-type]


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration):
    """A Qwen3.5-MoE vision-language checkpoint served as its language model."""
