"""Routed mixture-of-experts: softmax top-k routing and the grouped per-expert path (CPU; on the GPU the fused
kernel of layers/fused_moe.py runs the experts, inside captured steps too).

Grouped: the (row, expert) pairs of a step are sorted by expert; each expert that any row chose runs once, as an
ordinary SwiGLU MLP over exactly the rows routed to it, and its weighted output is added into those rows. An expert's
weights are read once per step however many rows chose it, so a verify block of K + 1 rows reads the union of their
experts rather than K + 1 times top-k of them; experts nobody chose are not touched.

Row invariance (what greedy speculative decoding == plain decoding leans on): a row's output is the sum of its top-k
weighted expert outputs added in ascending expert id, starting from zero, whatever else is in the batch: experts are
visited in id order and `index_add_` adds into each row at most once per expert. Routing (softmax, top-k,
renormalization) is per row. So with row-invariant linears (the batch-invariant GEMM, layers/invariant_linear.py,
which `make_batch_invariant` swaps in for the experts' nn.Linears and which the router takes by itself) the MoE
output of a row is bitwise the same alone, in a decode batch or in a verify block. With plain GEMMs it varies as the
dense MLP's GEMMs do (an expert's GEMM sees a varying number of rows, as a dense GEMM sees a varying M): ulps in fp32.
HF's Qwen3MoeExperts adds in the same order, which keeps fp32 parity with it tight.

The experts are ordinary modules (decoder.MLP: packed gate|up, then down), so the platform variants of the linears
(cpu_packed, cpu_quant, batch_invariant, tensor-parallel slices) apply to them unchanged."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.errors import ConfigError
from blockspec.layers import kernels


class Router(nn.Linear):
    """The routing projection hidden -> expert logits (HF's `mlp.gate`, llama.cpp's ffn_gate_inp). A subclass, not an
    nn.Linear, on purpose: the platform passes swap only exact nn.Linears, and the router must keep its weights
    unquantized (llama.cpp keeps ffn_gate_inp in F32: a quantized router flips expert choices, a much larger change
    than rounding a GEMM). It is tiny next to the experts, so nothing is lost by not packing it. Wherever the fused
    kernels run (CUDA, or the Triton interpreter in tests) it runs the batch-invariant GEMM, so routing is row-invariant
    in batch-invariant mode too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.fused(x):
            from blockspec.layers.invariant_linear import invariant_linear  # imports triton

            return invariant_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) of each row: softmax over all experts in fp32, the k largest, and,
    with `normalize` (Qwen3-MoE's norm_topk_prob), rescaled to sum to one, as HF's Qwen3MoeTopKRouter does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: Sequence[nn.Module]) -> torch.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every row t of x [T, H], each expert run once over the rows
    routed to it, the terms of a row added in ascending expert id (module docstring: row invariance)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # the per-expert row counts come back to the host: no static shapes to capture (the fused kernel has them)
        raise ConfigError("the grouped mixture-of-experts path cannot run inside a CUDA graph (its experts are "
                          "not plain linears the fused kernel takes); run the MoE target with --enforce-eager")
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (row, expert) pairs grouped by expert, ascending
    rows = order // k
    pair_weights = weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)  # HF weights in the activations' dtype
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # one host sync per layer
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        r = rows[start:start + n]
        out.index_add_(0, r, experts[e](x[r]) * pair_weights[start:start + n])
        start += n
    return out


class SparseMoeBlock(nn.Module):
    """Top-k routed experts with softmax routing and no shared expert (Qwen3-MoE). Parameter names are HF's:
    `gate.weight` (the router, [num_experts, hidden]) and `experts.{e}.*` (each expert's MLP)."""

    def __init__(self, hidden_size: int, experts: nn.ModuleList, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = Router(hidden_size, len(experts), bias=False)
        self.experts = experts
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        # (gate|up [E, 2I, H], down [E, H, I]): the experts' weights stacked for the fused kernel (stack_experts)
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def stack_experts(self) -> None:
        """Stack the experts' weights for the fused GPU kernel (layers/fused_moe.py), where every expert is a plain
        bias-free MLP; others keep the grouped path."""
        plain = all(type(lin) is nn.Linear and lin.bias is None
                    for e in self.experts for lin in (e.gate_up_proj, e.down_proj))
        if plain:
            from blockspec.layers.fused_moe import stack_experts  # imports triton

            self.stacked = stack_experts(self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) [T, top_k] of each row of x [T, hidden]."""
        return softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.stacked is not None and kernels.fused(x):
            from blockspec.layers.fused_moe import fused_experts  # imports triton

            return fused_experts(x, weights, ids, *self.stacked)
        return grouped_experts(x, weights, ids, self.experts)

    def extra_repr(self) -> str:
        return f"num_experts={len(self.experts)}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"
