"""Tensor-parallel building blocks. Each takes this rank's slice of a full (single-device) weight.

- column-parallel: a plain nn.Linear (or a drafter's LinearQKV) holding some output rows (no communication: its
  output is split by heads or by intermediate channels, and the next row-parallel layer consumes exactly that split);
- row-parallel: holds the matching input columns; the partial products are all-reduced, the bias added once after;
- vocab-parallel embedding / lm_head: each rank holds ceil(V/N) vocabulary rows (the last shard zero-padded).
  The lm_head all-gathers its logit shards into the full [R, V] logits on every rank, so sampling, top-k/top-p and
  the p/q acceptance run the single-device code unchanged and give the same token everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from blockspec.models.qkv import LinearQKV


@dataclass(frozen=True)
class HeadSplit:
    """This rank's attention heads: q heads [q_start, q_start+q_count), kv heads [kv_start, kv_start+kv_count)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_split(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadSplit:
    """q heads are split evenly. kv heads too when world divides them; when world is a multiple of them, each kv
    head is replicated on world/num_kv_heads consecutive ranks, which are exactly the ranks holding its q heads."""
    q = num_heads // world
    if num_kv_heads % world == 0:
        kv = num_kv_heads // world
        return HeadSplit(rank * q, q, rank * kv, kv)
    return HeadSplit(rank * q, q, rank * num_kv_heads // world, 1)


def take_rows(t: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """A fresh tensor of the (start, count) row ranges of t, concatenated (the full tensor can then be freed)."""
    return torch.cat([t.narrow(0, start, count) for start, count in rows]).contiguous()


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def column_linear(linear: nn.Linear, rows: list[tuple[int, int]]) -> nn.Linear:
    """The output rows `rows` of `linear` (and their biases) as a new nn.Linear."""
    out = nn.Linear(linear.in_features, sum(c for _, c in rows), bias=linear.bias is not None, device="meta")
    out.weight = _frozen(take_rows(linear.weight.data, rows))
    if linear.bias is not None:
        out.bias = _frozen(take_rows(linear.bias.data, rows))
    return out


def column_qkv(proj: LinearQKV, rows: list[tuple[int, int]], num_heads: int, num_kv_heads: int) -> LinearQKV:
    """The output rows `rows` of a packed q|k|v projection (this rank's heads) as a new LinearQKV."""
    with torch.device("meta"):
        out = LinearQKV(proj.in_features, num_heads, num_kv_heads, proj.head_dim, proj.bias is not None)
    out.weight = _frozen(take_rows(proj.weight.data, rows))
    if proj.bias is not None:
        out.bias = _frozen(take_rows(proj.bias.data, rows))
    return out


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, start: int, count: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = _frozen(linear.weight.data[:, start:start + count].contiguous())  # [out, count]
        self.bias = None if linear.bias is None else _frozen(linear.bias.data.clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def input_columns(linear: nn.Linear, start: int, count: int) -> nn.Linear:
    """The input columns [start, start+count) of a bias-free `linear` as a new nn.Linear: its output is this rank's
    partial sum, summed over the ranks by whoever owns the whole sum (AllReduceSum around a mixture of experts)."""
    assert linear.bias is None, "a partial sum cannot carry the bias"
    out = nn.Linear(count, linear.out_features, bias=False, device="meta")
    out.weight = _frozen(linear.weight.data[:, start:start + count].contiguous())
    return out


class AllReduceSum(nn.Module):
    """A module whose output is this rank's partial sum (experts holding a slice of their intermediate channels),
    summed over the ranks once: one all-reduce per MoE layer, not one per expert that ran."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y


def vocab_shard(weight: torch.Tensor, rank: int, world: int) -> tuple[int, torch.Tensor]:
    """(first vocab id, [ceil(V/world), H] rows) of this rank; rows past V are zeros."""
    per = -(-weight.shape[0] // world)
    start = rank * per
    shard = weight.new_zeros(per, weight.shape[1])
    own = weight[start:start + per]
    shard[: own.shape[0]] = own
    return start, shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, start: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.start, self.group = weight, start, group  # weight [V/N (padded), H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, 0), self.weight).masked_fill(~mine[..., None], 0.0)
        dist.all_reduce(x, group=self.group)  # exactly one rank contributes each row: the sum is exact
        return x


class ParallelLMHead(nn.Module):
    def __init__(self, weight: nn.Parameter, vocab_size: int, world: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.vocab_size, self.world, self.group = weight, vocab_size, world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)  # [R, V/N]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
