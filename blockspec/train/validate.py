"""Held-out training sequences: the loss, per-slot accuracy and acceptance length of the training blocks that the
drafter reaches on sequences it never trains on, and the tau of the verification walk over them (train/walk.py:
the engine's tau on those texts when every response position is an anchor). Next to the same figures of the training
windows this shows overfitting directly; the engine's tau on evaluation prompts mixes it with the shift to another
prompt set."""

from __future__ import annotations

from typing import Any

import torch

from blockspec.errors import BlockspecError
from blockspec.train.batches import Capacity, MicroBatch, build_micro_batch, generator, plan_epoch
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import TrainingSet
from blockspec.train.distributed import DataParallel
from blockspec.train.forward import TrainingForward
from blockspec.train.metrics import Window
from blockspec.train.walk import visited_blocks


def split_validation(data: TrainingSet, fraction: float, seed: int) -> tuple[TrainingSet, TrainingSet | None]:
    """(training set, held-out set or None): round(fraction x sequences) sequences, at least 1, drawn by seed."""
    if fraction <= 0:
        return data, None
    n = len(data.seqs)
    k = max(1, round(n * fraction))
    if k >= n:
        raise BlockspecError(f"val_fraction={fraction} holds out {k} of {n} sequences: nothing left to train on")
    held = sorted(torch.randperm(n, generator=generator(seed, 3)).tolist()[:k])
    out = set(held)
    keep = [i for i in range(n) if i not in out]
    train = TrainingSet([data.seqs[i] for i in keep], [data.anchors[i] for i in keep], data.num_dropped,
                        data.num_cut)
    return train, TrainingSet([data.seqs[i] for i in held], [data.anchors[i] for i in held], 0, 0)


@torch.no_grad()
def validate(fwd: TrainingForward, val: TrainingSet, cap: Capacity, cfg: TrainConfig, mask_token_id: int,
             slot_w: torch.Tensor, dp: DataParallel | None = None) -> dict[str, Any]:
    """Weighted loss, per-slot argmax accuracy (slots 1..B-1) and block acceptance length over the held-out set,
    with the same anchors at every call (fixed generators), so successive values are comparable. dp: each rank
    scores its share of the held-out micro-batches; every rank returns the figures of all of them."""
    B, device = cap.block_size, fwd.device
    plan = plan_epoch([len(s.input_ids) for s in val.seqs], val.anchors, cap, generator(cfg.seed, 4))
    window = Window(B, device, selector=fwd.selector is not None)
    walk_tokens = walk_steps = torch.zeros((), device=device)

    def micro_batch(j: int) -> MicroBatch:
        return build_micro_batch([val.seqs[i] for i in plan[j]], cap, cfg.num_anchors, mask_token_id, slot_w,
                                 generator(cfg.seed, 5, j))

    mine = range(len(plan)) if dp is None else dp.share(0, len(plan))
    for j in mine:
        mb = micro_batch(j)
        window.weight += float(mb.weights.sum())  # on the host, before the copy
        mb = mb.to(device)
        r = fwd(mb)
        window.add(r, mb)
        visited = visited_blocks(mb, r.block_accepted.long(), B, cap.tokens).float()
        walk_tokens = walk_tokens + ((r.block_accepted + 1) * visited).sum()
        walk_steps = walk_steps + visited.sum()
    if dp is not None:
        if dp.fsdp:  # every rank joins as many target passes (each layer's all-gather) as the busiest rank
            for _ in range(dp.passes(0, len(plan)) - len(mine)):
                fwd.target_only(micro_batch(0).to(device))
        window.all_reduce(dp)
        walk = torch.stack([walk_tokens, walk_steps])
        dp.sum_([walk])
        walk_tokens, walk_steps = walk[0], walk[1]
    s = window.summary()
    keys = ("loss", "acc", "acc_mean", "tau", "selector_loss", "candidate_recall")  # the last two: DFlash 2
    return ({k: s[k] for k in keys if k in s}
            | {"walk_tau": walk_tokens.item() / max(walk_steps.item(), 1.0), "sequences": len(val.seqs)})
