"""Fused mixture-of-experts for the GPU (Triton): the routed experts of a step without a host sync, so the decode and
verify steps of an MoE target run inside the captured CUDA graph (layers/moe.py's grouped path reads per-expert row
counts on the host and cannot).

Pairs: each (row, chosen expert) of the step is a pair, p = row * top_k + j. `align_pairs` sorts the pairs by expert
on the device and pads each expert's run to a whole tile of BLOCK_M pairs (the layout vLLM's and SGLang's fused MoE
use, written here from torch ops whose shapes depend only on T, top_k and the expert count, so a graph can capture
them); the tiles past the step's last are marked with expert id E and load nothing. The grouped GEMM then runs one
program per (tile, output block): its pairs all use one expert, whose weight block is read once for all of them, so
a verify block of K + 1 rows reads the union of its rows' experts, each once per step.

Row invariance: a pair's output is computed by the same instructions in the same order (the K loop from 0 in
BLOCK_K steps under one fixed tile) whatever else is in its tile or the step, and a row's terms are added in
ascending expert id from its first, as the grouped path adds them; so a row's MoE output is bitwise the same alone,
in a decode batch or in a verify block (greedy speculative decoding == plain decoding, in bf16 too).

The experts' weights are stacked once at load ([E, 2I, H] gate|up, [E, H, I] down) and each expert's linears are
re-pointed at its slice, so the eager modules and the fused kernel share one copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 16, 64, 64, 4, 3  # decode / verify sizes: few pairs per expert


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs [tiles * block_m]: pair indices grouped by expert, ascending, each expert's run padded
    with T * k to whole tiles; tile_expert [tiles]: each tile's expert, num_experts past the last used tile).
    Device ops only: nothing returns to the host."""
    flat = ids.reshape(-1)
    P = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert, ascending
    expert = flat[order]
    rank = torch.arange(P, device=ids.device) - (counts.cumsum(0) - counts)[expert]  # place within its expert's run
    tiles = (P + min(num_experts, P) * (block_m - 1)) // block_m + 1  # an upper bound whatever the routing
    pairs = torch.full((tiles * block_m,), P, dtype=torch.int64, device=ids.device)
    pairs.scatter_(0, (ends - padded)[expert] + rank, order)
    starts = torch.arange(tiles, device=ids.device) * block_m
    return pairs, torch.searchsorted(ends, starts, right=True)


@triton.jit(do_not_specialize=["P"])
def _grouped_gemm(x_ptr, w_ptr, y_ptr, pairs_ptr, tile_expert_ptr, P, N, K, E, TOP_K: tl.constexpr,
                  X_PER_PAIR: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """y[p, n] = sum_k x[row of p, k] * w[expert of p's tile, n, k] for the tile's pairs p (x [T or P, K], w [E, N,
    K], y [P, N]); a tile of expert E (past the last) loads and stores nothing."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    e = tl.load(tile_expert_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    p_ok = (pairs < P) & ((tl.zeros_like(pairs) + e) < E)
    rows = pairs if X_PER_PAIR else pairs // TOP_K
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (rn < N) & ((tl.zeros_like(rn) + e) < E)
    rk = tl.arange(0, BLOCK_K)
    w = w_ptr + tl.minimum(e, E - 1) * N * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(x_ptr + rows[:, None] * K + (k0 + rk)[None, :], mask=p_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + rn[:, None] * K + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision=PREC).to(tl.float32)
    tl.store(y_ptr + pairs[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=p_ok[:, None] & n_ok[None, :])


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, tile_expert: torch.Tensor, num_pairs: int,
                 top_k: int, x_per_pair: bool) -> torch.Tensor:
    """[num_pairs, N] in x's dtype: each pair's row of x (x [T, K] indexed by pair // top_k, or x [P, K] by pair)
    times its expert's w [E, N, K]^T, fp32 accumulation."""
    E, N, K = w.shape
    y = torch.empty(num_pairs, N, dtype=x.dtype, device=x.device)
    grid = (tile_expert.numel(), triton.cdiv(N, BLOCK_N))
    _grouped_gemm[grid](x.contiguous(), w, y, pairs, tile_expert, num_pairs, N, K, E, TOP_K=top_k,
                        X_PER_PAIR=x_per_pair, PREC="ieee" if x.dtype == torch.float32 else "tf32",
                        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS, num_stages=STAGES)
    return y


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x [T, H], gate_up [E, 2I, H], down [E, H, I]: what
    moe.grouped_experts computes (SwiGLU in x's dtype, each term weighted in x's dtype, the terms of a row added in
    ascending expert id), each expert's weights read once per step."""
    T, k = ids.shape
    pairs, tile_expert = align_pairs(ids, gate_up.shape[0])
    gu = grouped_gemm(x, gate_up, pairs, tile_expert, T * k, k, x_per_pair=False)
    inter = gu.shape[1] // 2
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = grouped_gemm(act, down, pairs, tile_expert, T * k, k, x_per_pair=True).view(T, k, -1)
    by_id, perm = ids.sort(dim=1)  # a row's experts are distinct: ascending id
    terms = y.gather(1, perm[..., None].expand(T, k, y.shape[-1])) * weights.gather(1, perm).to(x.dtype)[..., None]
    out = torch.zeros_like(x)
    for j in range(k):  # from zero, in ascending expert id, as index_add_ adds them per expert
        out = out + terms[:, j]
    return out


@torch.no_grad()
def stack_experts(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' gate|up [E, 2I, H] and down [E, H, I] weights as two stacked tensors; each expert's linears are
    re-pointed at their slice (one copy in memory, shared by the eager modules and the fused kernel)."""
    gate_up = torch.stack([e.gate_up_proj.weight for e in experts])
    down = torch.stack([e.down_proj.weight for e in experts])
    for i, e in enumerate(experts):
        e.gate_up_proj.weight = nn.Parameter(gate_up[i], requires_grad=False)
        e.down_proj.weight = nn.Parameter(down[i], requires_grad=False)
    return gate_up, down
