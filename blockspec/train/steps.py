"""The micro-batches of each optimizer step: all of them in one process; under data parallelism this rank's share,
with the totals of the whole step, so the loss is one weighted mean over the global batch whatever the world size.

A step is the plan indices [start, start + grad_accum) of one epoch (fewer at the epoch's end); micro-batch j's
sequences and anchors depend on (seed, epoch, j) only, so which rank builds it changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.train.batches import Capacity, MicroBatch, build_micro_batch, generator
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import TrainingSet
from blockspec.train.distributed import DataParallel


@dataclass
class Step:
    mbs: list[MicroBatch]  # this rank's, on the device
    weight: float  # total loss weight of the whole step (every rank's micro-batches)
    local_weight: float  # of this rank's micro-batches
    count: int  # micro-batches in the whole step
    tokens: int  # real target tokens in the whole step
    blocks: int  # anchor blocks in the whole step
    # FSDP: micro-batches whose target pass this rank runs only so that every rank joins every layer's all-gather
    fillers: list[MicroBatch] = field(default_factory=list)


class StepBatches:
    def __init__(self, data: TrainingSet, plans: list[list[list[int]]], cap: Capacity, cfg: TrainConfig,
                 mask_token_id: int, slot_w: torch.Tensor, device: torch.device, dp: DataParallel | None) -> None:
        self.data, self.plans, self.cap, self.cfg = data, plans, cap, cfg
        self.mask_token_id, self.slot_w, self.device, self.dp = mask_token_id, slot_w, device, dp

    def build(self, epoch: int, j: int) -> MicroBatch:
        return build_micro_batch([self.data.seqs[i] for i in self.plans[epoch][j]], self.cap, self.cfg.num_anchors,
                                 self.mask_token_id, self.slot_w, generator(self.cfg.seed, 1, epoch, j))

    def __call__(self, epoch: int, start: int) -> Step:
        dp = self.dp
        stop = min(start + self.cfg.grad_accum, len(self.plans[epoch]))
        mbs = [self.build(epoch, j) for j in (range(start, stop) if dp is None else dp.share(start, stop))]
        sizes = [(float(mb.weights.sum()), mb.num_tokens, mb.num_blocks) for mb in mbs]  # on the host
        # every rank's, summed in plan order: the same float as one process's sum
        everyone = sizes if dp is None else dp.in_plan_order(dp.gather(sizes))
        fillers = []
        if dp is not None and dp.fsdp and len(mbs) < dp.passes(start, stop):
            fillers = [self.build(epoch, start).to(self.device)] * (dp.passes(start, stop) - len(mbs))
        return Step([mb.to(self.device) for mb in mbs], sum(w for w, _, _ in everyone), sum(w for w, _, _ in sizes),
                    stop - start, sum(t for _, t, _ in everyone), sum(b for _, _, b in everyone), fillers)
