"""The stages of one speculative step that both engine paths share (the varlen step and the captured decode step):

  verify          the target over every row of the step, with the proposer's taps     -> VerifyStep
  accept          a batch of verify blocks through the policy (speculative/acceptance.py) -> Accepted
  commit_slots    the rows whose tokens were committed keep their slots, the rest get -1
  commit_state    a hybrid target's verify blocks: the recurrent state after their accepted rows (a replay)
  append context  Proposer.append_context(models, CommittedRows)
  propose         Proposer.propose from each new bonus, sampled drafts drawn   -> (drafts, q)

All of them run on a StepModels record (blockspec/speculative/proposer.py), on the device, without a host sync: the
captured decode step runs them inside its CUDA graph, the varlen step once per group of requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.models.hybrid_state import RecurrentBatch
from blockspec.sampling import SamplingRows
from blockspec.speculative.acceptance import AcceptancePolicy, accept_block
from blockspec.speculative.drafts import sample_drafts
from blockspec.speculative.proposer import DraftBatch, StepModels


@dataclass
class VerifyStep:
    logits: torch.Tensor  # [R, V] fp32 at the requested rows (all rows when none were named)
    taps: torch.Tensor | None  # [T, len(tap_layers) * H] at every row (None without a proposer that taps)


def verify(models: StepModels, ids: torch.Tensor, batch: PagedBatch, logit_rows: torch.Tensor | None = None,
           recurrent: RecurrentBatch | None = None) -> VerifyStep:
    """One target forward over the step's rows (prefill chunks and/or [bonus, d_1..d_K] blocks), writing their
    target K/V at batch.slot_mapping. recurrent: a hybrid target's state slots for these rows (its verify blocks
    keep their rows' inputs and leave their slots for commit_state)."""
    extra = {} if recurrent is None else {"state": recurrent}
    out = models.target(ids, batch.positions, models.backend.target(models.pool, batch), tap_layers=models.tap_layers,
                        logit_rows=logit_rows, **extra)
    return VerifyStep(out.logits, out.taps)


def commit_state(models: StepModels, recurrent: RecurrentBatch | None, num_accepted: torch.Tensor) -> None:
    """After accept: each verify block's recurrent state <- the state after its bonus and its num_accepted [B]
    accepted drafts (per sequence of the forward, in its order; entries of other sequences are not read)."""
    if recurrent is not None and recurrent.keeps:
        models.target.commit_state(recurrent, num_accepted)


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions [B, N] of requests with block_tables [B, W] -> their KV slots [B, N]."""
    return block_tables.gather(1, positions // block_size) * block_size + positions % block_size


def commit_slots(slots: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """slots [G, K+1] of verify blocks -> the same with -1 past row n (the bonus and the n accepted drafts are
    committed; the rest were rejected, and their target K/V, already written, is overwritten later)."""
    rows = torch.arange(slots.shape[1], device=slots.device)
    return torch.where(rows[None, :] <= num_accepted[:, None], slots, -1)


@dataclass
class Accepted:
    """The accept stage's result for G verify blocks of K drafts each, starting at block_start."""

    tokens: torch.Tensor  # [G, K+1] int64 emitted: d_1..d_n, then the target's token at row n, -1 after it
    num_accepted: torch.Tensor  # [G] int64 n
    block_start: torch.Tensor  # [G] int64 the position of each block's first row (its bonus)

    @property
    def bonus(self) -> torch.Tensor:
        """[G] the last emitted token: the first row of the request's next step (computed when a proposer asks)."""
        return self.tokens.gather(1, self.num_accepted[:, None])[:, 0]

    @property
    def start(self) -> torch.Tensor:
        """[G] the new bonus's position."""
        return self.block_start + self.num_accepted + 1


def accept(policy: AcceptancePolicy, drafts: torch.Tensor, chosen: torch.Tensor, rows: SamplingRows,
           start: torch.Tensor, q: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> Accepted:
    """drafts [G, K], the target's choice at each verify row chosen [G, K+1], the requests' sampling rows [G] and
    bonus positions start [G]; with sampled drafts their q [G, K, V] (speculative/drafts.verify_q) and the verify
    logits [G, K+1, V]. K = 0 (plain decoding) emits the target's choice."""
    if drafts.shape[1] == 0:
        tokens, n = chosen, torch.zeros_like(start)
    else:
        tokens, n = accept_block(policy, drafts, chosen, rows, start, q, logits)
    return Accepted(tokens, n, start)


def propose(models: StepModels, bonus: torch.Tensor, start: torch.Tensor, block_tables: torch.Tensor, K: int,
            rows: SamplingRows, max_kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next K drafts of B requests from their new bonus [B] at `start` [B] -> (drafts [B, K], q [B, K, V] or
    None). Under probabilistic drafting with a sampled row the drafts are drawn from the drafter's distribution q
    (by the proposer itself, as DFlash 2's selector does, else here from its logits); greedy rows keep argmax drafts.
    max_kv_len: a host bound for the reference attention (None inside a captured step)."""
    proposer = models.proposer
    sample = proposer.probabilistic and not rows.all_greedy
    R = proposer.draft_rows(K)
    query_start = torch.arange(0, (bonus.shape[0] + 1) * R, R, dtype=torch.int32, device=bonus.device)
    batch = DraftBatch(bonus, start, block_tables, query_start, K, R, max_kv_len, rows if sample else None)
    proposal = proposer.propose(models, batch, want_logits=sample)
    if not sample:
        return proposal.drafts, None
    if proposal.q is not None:
        return proposal.drafts, proposal.q
    return sample_drafts(proposal.logits, proposal.drafts, rows, start)
