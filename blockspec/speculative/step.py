"""The stages of one speculative step that both engine paths share (the varlen step and the captured decode step):

  verify          the target over every row of the step, with the proposer's taps     -> VerifyStep
  accept          blockspec/speculative/acceptance.py (a policy passed to the engine)
  commit_slots    the rows whose tokens were committed keep their slots, the rest get -1
  append context  Proposer.append_context(models, CommittedRows)
  propose         Proposer.propose(models, DraftBatch)

All of them run on a StepModels record (blockspec/speculative/proposer.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.speculative.proposer import StepModels


@dataclass
class VerifyStep:
    logits: torch.Tensor  # [R, V] fp32 at the requested rows (all rows when none were named)
    taps: torch.Tensor | None  # [T, len(tap_layers) * H] at every row (None without a proposer that taps)


def verify(models: StepModels, ids: torch.Tensor, batch: PagedBatch,
           logit_rows: torch.Tensor | None = None) -> VerifyStep:
    """One target forward over the step's rows (prefill chunks and/or [bonus, d_1..d_K] blocks), writing their
    target K/V at batch.slot_mapping."""
    out = models.target(ids, batch.positions, models.backend.target(models.pool, batch), tap_layers=models.tap_layers,
                        logit_rows=logit_rows)
    return VerifyStep(out.logits, out.taps)


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions [B, N] of requests with block_tables [B, W] -> their KV slots [B, N]."""
    return block_tables.gather(1, positions // block_size) * block_size + positions % block_size


def commit_slots(slots: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """slots [G, K+1] of verify blocks -> the same with -1 past row n (the bonus and the n accepted drafts are
    committed; the rest were rejected, and their target K/V, already written, is overwritten later)."""
    rows = torch.arange(slots.shape[1], device=slots.device)
    return torch.where(rows[None, :] <= num_accepted[:, None], slots, -1)
