"""gpt-oss's mixture of experts: a router with a bias whose top-k logits are softmaxed (over the chosen experts only),
and experts with biases and a clamped SwiGLU. Rows run through the grouped per-expert path of layers/moe.py (each
chosen expert once per step over its rows, terms added in ascending expert id, as HF's loop adds them).

One expert computes, as transformers' GptOssExperts does: gate = min(gate, limit), up = clamp(up, -limit, limit),
out = down((up + 1) * gate * sigmoid(alpha * gate)) + biases. HF interleaves gate and up in one bank (gate the even
rows); the loader de-interleaves them into this module's packed gate|up rows (models/gpt_oss.py), so an expert's
linears are ordinary nn.Linears that the platform variants (packed, quantized) swap like any other."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.layers.moe import Router, grouped_experts


class ClampedSwiGLUExpert(nn.Module):
    """x [n, hidden] -> [n, hidden]; `gate_up_proj` [2I, hidden] (gate rows, then up rows) and `down_proj` [hidden, I],
    both with biases."""

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=True)
        self.down_proj = nn.Linear(intermediate, hidden, bias=True)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)  # clamped above only: a large negative gate is already ~0 after the sigmoid
        up = up.clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]): the k largest logits of each row, softmaxed among themselves in the
    logits' dtype (HF's GptOssTopKRouter); the other experts get nothing."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class TopKSoftmaxMoeBlock(nn.Module):
    """HF's names: `router.weight` [E, hidden], `router.bias` [E], `experts.{e}.*`."""

    def __init__(self, hidden: int, experts: nn.ModuleList, top_k: int) -> None:
        super().__init__()
        self.router = Router(hidden, len(experts), bias=True)  # never packed or quantized (layers/moe.py: Router)
        self.experts = experts
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(self.router(x), self.top_k)
        return grouped_experts(x, weights, ids, self.experts)

    def extra_repr(self) -> str:
        return f"num_experts={len(self.experts)}, top_k={self.top_k}"
