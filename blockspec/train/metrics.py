"""Running training metrics over a window of micro-batches: weighted loss, draft accuracy per block slot (the argmax;
for DFlash 2 the selector's pick given the true previous token) and the acceptance length those hits give on the
blocks; for a DFlash 2 drafter also the selector's loss over the rows whose label is one of its candidates and the
weighted share of those rows, the candidates' recall (device tensors, so adding never syncs with the host)."""

from __future__ import annotations

import time
from typing import Any

import torch

from blockspec.train.batches import MicroBatch
from blockspec.train.distributed import DataParallel
from blockspec.train.forward import ForwardResult


class Window:
    def __init__(self, block_size: int, device: torch.device, selector: bool = False) -> None:
        """selector: the drafter is a DFlash 2 one (its selector loss is summed too; on every rank alike, so that
        all_reduce sums the same tensors everywhere)."""
        self.B, self.device, self.selector = block_size, device, selector
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.selector_loss = torch.zeros((), device=self.device) if self.selector else None
        self.selector_weight = torch.zeros((), device=self.device)
        self.weight = 0.0  # total loss weight, added by the caller from host-side sums
        self.hits = torch.zeros(self.B, device=self.device)
        self.count = torch.zeros(self.B, device=self.device)
        self.accepted = torch.zeros((), device=self.device)
        self.tokens, self.blocks, self.t0 = 0, 0, time.perf_counter()

    def add(self, r: ForwardResult, mb: MicroBatch) -> None:
        self.loss += r.plain_loss_sum
        if self.selector_loss is not None and r.selector_loss_sum is not None and r.selector_weight is not None:
            self.selector_loss += r.selector_loss_sum
            self.selector_weight += r.selector_weight
        self.hits.index_add_(0, r.slots, r.hits.float())
        self.count.index_add_(0, r.slots, torch.ones_like(r.slots, dtype=torch.float32))
        self.accepted += r.accepted
        self.tokens += mb.num_tokens
        self.blocks += mb.num_blocks

    def all_reduce(self, dp: DataParallel) -> None:
        """Make this window every rank's together (on every rank, before summary())."""
        dp.sum_([self.loss, self.hits, self.count, self.accepted]
                + ([self.selector_loss, self.selector_weight] if self.selector_loss is not None else []))
        host = torch.tensor([self.weight, self.tokens, self.blocks], dtype=torch.float64, device=self.device)
        dp.sum_([host])
        self.weight, self.tokens, self.blocks = host[0].item(), round(host[1].item()), round(host[2].item())

    def summary(self) -> dict[str, Any]:
        """loss (weighted mean), acc [B-1] (slots 1..B-1), acc_mean, tau (per block), tokens_per_s since reset;
        DFlash 2: selector_loss (weighted mean over the rows whose label is a candidate) and candidate_recall (the
        weighted share of those rows: no pick can be right elsewhere)."""
        acc = (self.hits / self.count.clamp(min=1))[1:].tolist()
        dt = time.perf_counter() - self.t0
        out = {"loss": self.loss.item() / max(self.weight, 1e-12), "acc": [round(a, 4) for a in acc],
               "acc_mean": sum(acc) / len(acc), "tau": 1 + self.accepted.item() / max(self.blocks, 1),
               "tokens_per_s": self.tokens / dt if dt > 0 else 0.0}
        if self.selector_loss is not None:
            found = self.selector_weight.item()
            out["selector_loss"] = self.selector_loss.item() / max(found, 1e-12)
            out["candidate_recall"] = found / max(self.weight, 1e-12)
        return out
