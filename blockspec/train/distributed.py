"""Data-parallel drafter training: which rank this process is, and the few collectives the trainer needs.

Every rank holds the whole drafter, its optimizer state and the same plan of micro-batches (a function of the seed).
An optimizer step's micro-batches are shared out over the ranks and one all-reduce per step sums the ranks'
gradients, so every rank applies the same update and the replicas never drift apart: what DDP does under gradient
accumulation (it too reduces once per optimizer step), done by hand because the drafter's training forward is several
calls rather than one module call and, at an epoch's end, a short step can leave a rank without a micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from blockspec.errors import BlockspecError, ConfigError

T = TypeVar("T")
BUCKET_BYTES = 256 << 20  # per all-reduce of gradients


def check_global_batch(grad_accum: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step: --grad-accum is the global batch, shared equally by the ranks."""
    if grad_accum % world_size:
        lower, upper = grad_accum // world_size * world_size, -(-grad_accum // world_size) * world_size
        options = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise ConfigError(f"--grad-accum {grad_accum} (micro-batches per optimizer step over all ranks, default 1: "
                          f"the global batch) is not a multiple of the world size {world_size}, so the ranks cannot share it "
                          f"equally; use {options}", field="grad_accum")
    return grad_accum // world_size


class AllRanksError(BlockspecError):
    """Raised on every rank at the same point (DataParallel.agree / together): no rank is left inside a collective,
    so the ranks can wait for each other before tearing down (launch.leave(together=True)); a gloo rank that tears
    down while its peer still talks to it makes that peer abort (exit -6) after its one line."""


@dataclass(frozen=True)
class DataParallel:
    rank: int
    world_size: int
    device: torch.device  # this rank's: cuda:LOCAL_RANK, or the CPU
    group: dist.ProcessGroup  # device tensors: gradients, metrics, FSDP's all-gathers (NCCL on CUDA, gloo on CPU)
    control: dist.ProcessGroup  # host objects (gloo): settings, fingerprints, step sizes, errors
    fsdp: bool = False  # the target's decoder layers are sharded over the ranks (train/fsdp.py)

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes checkpoints, the export, the log and the report, and runs the engine's tau."""
        return self.rank == 0

    def share(self, start: int, stop: int) -> range:
        """This rank's micro-batches among a step's plan indices [start, stop): every world_size-th, so a short step at
        an epoch's end leaves the last ranks one fewer rather than one rank all of them."""
        return range(start + self.rank, stop, self.world_size)

    def passes(self, start: int, stop: int) -> int:
        """The most micro-batches any rank has in the step [start, stop): with FSDP every rank runs that many target
        passes, since each pass all-gathers every layer's weights from all ranks."""
        return -(-(stop - start) // self.world_size)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def in_plan_order(self, per_rank: list[list[T]]) -> list[T]:
        """The items of every rank's share of one step (from gather) back in plan order."""
        return [per_rank[r][k] for k in range(max(map(len, per_rank))) for r in range(self.world_size)
                if k < len(per_rank[r])]

    def agree(self, what: str, value: Any, fix: str) -> None:
        """Raise on every rank if any rank's value differs from rank 0's: ranks that disagree on the settings or the
        data would plan different steps and wait for each other forever."""
        values = self.gather(value)
        for r, v in enumerate(values):
            if v != values[0]:
                raise AllRanksError(f"rank {r}'s {what} differs from rank 0's{_difference(values[0], v)}: {fix}")

    def together(self, fn: Callable[[], T]) -> T:
        """fn() on every rank; if it failed on any rank, every rank raises that failure (the first rank's), so none is
        left waiting in a later collective for a rank that is gone."""
        try:
            result, failure, error = fn(), None, None
        except Exception as e:  # noqa: BLE001 - reported to the other ranks, then re-raised here as it was
            result, failure, error = None, (str(e) if isinstance(e, BlockspecError) else f"{type(e).__name__}: {e}"), e
        failures = self.gather(failure)
        if error is not None and not isinstance(error, BlockspecError):
            raise error  # a bug: keep its traceback on the rank where it happened
        bad = next((r for r, f in enumerate(failures) if f is not None), None)
        if bad is not None:
            raise AllRanksError(f"rank {bad}: {failures[bad]}")
        return result  # type: ignore[return-value]

    def any(self, flag: bool) -> bool:
        return any(self.gather(flag))

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor over the ranks, in place (an all-reduce per bucket of tensors)."""
        for bucket in _buckets(tensors):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.group)
            for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(reduced)

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values into every rank's tensors."""
        for bucket in _buckets(tensors):
            flat = _flatten_dense_tensors(bucket)
            dist.broadcast(flat, 0, group=self.group)
            for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(value)


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, up to BUCKET_BYTES each: few collectives, and no flat copy of a whole
    drafter's gradients at once (1B parameters would be 4 GB)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or t.dtype != out[-1][0].dtype or size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def _difference(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)]
        return " (" + ", ".join(f"{k}: {_short(b.get(k))} vs {_short(a.get(k))}" for k in keys[:3]) + ")"
    return f" ({_short(b)} vs {_short(a)})"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
