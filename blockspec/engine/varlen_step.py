"""The varlen step: any mix of prefill chunks and verify blocks in ONE target forward over every scheduled row (taps
at all rows), then on the device: the first token of each prefill that ends, acceptance per verify group (one K
each), the proposer's context of the committed rows (same slots; rejected rows get -1), the next drafts per propose
group (one K' each) from every new bonus; a hybrid target's verify blocks get their recurrent state after their
accepted rows (commit_state, once every group is accepted). One host-to-device copy of the step's index lists
(StepLayout), one device-to-host copy of its results."""

from __future__ import annotations

import torch

from blockspec.attention.paged_ref import PagedBatch
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import StepResult, block_tables
from blockspec.engine.step_layout import Span, StepLayout, VarlenLayout
from blockspec.models.hybrid_state import RecurrentBatch
from blockspec.sampling import SamplingRows, sample_rows
from blockspec.speculative.acceptance import AcceptancePolicy
from blockspec.speculative.drafts import verify_q
from blockspec.speculative.proposer import CommittedRows, StepModels
from blockspec.speculative.step import accept, commit_state, propose, verify


def varlen_step(models: StepModels, acceptance: AcceptancePolicy, scheduled: list[ScheduledSeq],
                vocab_size: int, device: torch.device) -> list[StepResult]:
    layout = StepLayout.for_varlen(scheduled, models.pool.block_size, vocab_size)
    v, seqs = layout.varlen, [s.seq for s in scheduled]
    rows = layout.sampling_rows(device, vocab_size)  # [B]: each stage selects its requests' rows
    dev = v.pack.upload(device)
    batch = PagedBatch(v.positions.of(dev), v.slots.of(dev), v.query_start.of(dev).int(), v.kv_lens.of(dev).int(),
                       block_tables(seqs, max(len(s.block_table) for s in seqs), device), v.max_query_len,
                       v.max_kv_len)
    token_ids = v.input_ids.of(dev)
    recurrent = _recurrent(models, v, batch, dev)
    out = verify(models, token_ids, batch, v.logit_rows.of(dev), recurrent)
    chosen = sample_rows(out.logits, _select(rows, v.logit_request, v.logit_flags, dev), v.sample_pos.of(dev))
    results: list[torch.Tensor] = []  # what the host copy holds, in its order (VarlenLayout)
    bonus: list[torch.Tensor] = []  # the new bonuses and their positions, in their order (VarlenLayout)
    start: list[torch.Tensor] = []
    if v.firsts.shape[0]:
        results.append(first := chosen[v.firsts.of(dev)])
        bonus.append(first)
    if v.prefill_start.shape[0]:
        bonus.append(v.resumed.of(dev))
        start.append(v.prefill_start.of(dev))
    keep = torch.ones(token_ids.shape[0], dtype=torch.bool, device=device)  # rows whose context is committed
    accepted = torch.zeros(len(seqs), dtype=torch.long, device=device)  # per request: drafts accepted
    for g in v.verify:
        offs = torch.arange(g.K + 1, device=device)
        at = g.logit_row.of(dev)[:, None] + offs  # [G, K+1] their logit rows
        q = verify_q([seqs[i].drafts for i in g.index], g.K)
        acc = accept(acceptance, g.drafts.of(dev), chosen[at], _select(rows, g.request, g.flags, dev),
                     g.start.of(dev), q, out.logits[at] if q is not None else None)
        results.append(torch.cat([acc.tokens, acc.num_accepted[:, None]], dim=1).flatten())
        keep[(g.row.of(dev)[:, None] + offs).flatten()] = (offs[None] <= acc.num_accepted[:, None]).flatten()
        if recurrent is not None:
            accepted = acc.num_accepted if g.request is None else accepted.index_copy(0, g.request.of(dev),
                                                                                       acc.num_accepted)
        if v.propose:
            bonus.append(acc.bonus)
            start.append(acc.start)
    commit_state(models, recurrent, accepted)
    if models.proposer is not None:
        models.proposer.append_context(models, CommittedRows(token_ids, batch, torch.where(keep, batch.slot_mapping, -1),
                                                             out.taps, propose_next=bool(v.propose)))
    q_next: dict[int, torch.Tensor] = {}
    if v.propose:
        bonus_all, start_all = torch.cat(bonus), torch.cat(start)
        for g in v.propose:
            at = g.bonus.of(dev)
            tables = batch.block_tables if g.request is None else batch.block_tables[g.request.of(dev)]
            drafts, q = propose(models, bonus_all[at], start_all[at], tables, g.K, _select(rows, g.request, g.flags, dev),
                                g.max_kv_len)
            results.append(drafts.flatten())
            if q is not None:
                q_next.update((i, q[j]) for j, i in enumerate(g.index))
    host = torch.cat(results).tolist() if results else []  # the step's one device-to-host copy
    return layout.results(host, q_next)


def _recurrent(models: StepModels, v: VarlenLayout, batch: PagedBatch, dev: torch.Tensor) -> RecurrentBatch | None:
    """A hybrid target's state slots for the step's rows, grouped from the host's row offsets (no device sync)."""
    if models.state is None or v.state_slots is None:
        return None
    return RecurrentBatch.build(models.state, v.state_slots.of(dev), batch.query_start, batch.positions, v.keep,
                                v.row_starts)


def _select(rows: SamplingRows, request: Span | None, flags: dict[str, bool], dev: torch.Tensor) -> SamplingRows:
    """The sampling rows of these requests (None: every request, in order: the step's rows as they are)."""
    return rows if request is None else rows.select(request.of(dev), flags)
