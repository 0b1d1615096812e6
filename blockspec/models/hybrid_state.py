"""Per-sequence recurrent state of hybrid models (Gated DeltaNet layers beside full attention: Qwen3.5 / Qwen3.6), the
model side of it: where the state lives, how one forward addresses it, and the exact rollback after a verify.

A full-attention layer keeps its K/V in the paged pool, one row per token. A linear-attention layer keeps, per
sequence, a fixed-size state whatever the length: its conv window (the last K-1 inputs of its short convolution,
[conv_dim, K-1]) and its delta-rule state ([num_v_heads, k_dim, v_dim], fp32). Each running sequence owns a state
slot for its life; `RecurrentState` holds the slots of every linear layer, and a forward names each sequence's slot
in a `RecurrentBatch`, beside the attention metadata.

Rollback. KV rows of rejected drafts are harmless (overwritten later, never read before), but a recurrent state has
absorbed every row it was run over. So a verify block runs with `keep_rows`: its slot is left as it was, and the
state after EACH row goes into a scratch at (batch position, row); after acceptance `RecurrentState.commit` copies
the state after row n (n accepted drafts: rows bonus, d_1..d_n committed) into the slot, on the device.

What the engine does (the integration step, not here yet):
  1. allocate `RecurrentState(model.recurrent_shape(), num_slots, dtype, device, keep_seqs, keep_rows)` beside a
     KVPool of `model.num_kv_layers` layers (only full-attention layers have K/V); keep_seqs >= the largest verify
     batch, keep_rows >= K + 1;
  2. give each sequence a slot when it starts, free it when it finishes (nothing to clear: a sequence whose first
     row is at position 0 starts from zeros, `fresh`, and its slot's old contents are never read);
  3. each forward: `RecurrentBatch.build(state, slots, query_start, positions, keep_rows)` -> model(..., state=...);
  4. after a verify step: `state.commit(batch, accepted)`.
Prefix-cache hits and preemption need the state at the hit point, which is not kept: such a sequence is recomputed
from position 0, or its state snapshotted with `copy_slots`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

RECURRENT_MAX_ROWS = 16  # a sequence with at most this many rows runs row by row (decode, verify); longer ones chunked


@dataclass(frozen=True)
class RecurrentShape:
    """The state one sequence keeps per linear-attention layer."""

    num_layers: int  # linear-attention layers; a layer's state index is its order among them
    conv_dim: int  # channels of the short conv: q|k|v = 2 * num_k_heads * k_dim + num_v_heads * v_dim
    conv_kernel: int  # K; the window keeps K - 1 inputs
    num_v_heads: int
    k_dim: int
    v_dim: int

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=conv_dtype).element_size()
        return self.num_layers * (conv + self.num_v_heads * self.k_dim * self.v_dim * 4)


class RecurrentState:
    """Every linear layer's state slots, and the per-row scratch of verify blocks."""

    def __init__(self, shape: RecurrentShape, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 keep_seqs: int = 0, keep_rows: int = 0) -> None:
        L, C, W = shape.num_layers, shape.conv_dim, shape.conv_kernel - 1
        H, Dk, Dv = shape.num_v_heads, shape.k_dim, shape.v_dim
        self.shape = shape
        self.conv = torch.zeros(L, num_slots, C, W, dtype=dtype, device=device)  # in the activations' dtype
        self.ssm = torch.zeros(L, num_slots, H, Dk, Dv, dtype=torch.float32, device=device)  # fp32, as computed
        # the state after each row of a keep_rows sequence, at (its batch position, row)
        self.conv_rows = torch.zeros(L, keep_seqs, keep_rows, C, W, dtype=dtype, device=device)
        self.ssm_rows = torch.zeros(L, keep_seqs, keep_rows, H, Dk, Dv, dtype=torch.float32, device=device)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    def commit(self, batch: RecurrentBatch, accepted: torch.Tensor) -> None:
        """After a keep_rows forward: each keep_rows sequence's slot <- its state after row accepted[b] ([B] int64,
        the number of accepted drafts); the other sequences' slots as they are. On the device, no host sync."""
        if batch.keep_rows is None:
            return
        B = batch.slots.shape[0]
        b = torch.arange(B, device=batch.slots.device)
        row = accepted.to(b.device).clamp(0, max(self.conv_rows.shape[2] - 1, 0))
        for live, rows in ((self.conv, self.conv_rows), (self.ssm, self.ssm_rows)):
            chosen = rows[:, b, row]  # [L, B, ...]
            keep = batch.keep_rows.view(1, B, *[1] * (chosen.dim() - 2))
            live[:, batch.slots] = torch.where(keep, chosen, live[:, batch.slots])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots dst <- slots src ([N] int64 each): a fork, or a snapshot kept for later."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm, self.conv_rows, self.ssm_rows))


@dataclass(frozen=True)
class SeqGroup:
    """Sequences of a batch computed together by a linear layer: the same row count and mode."""

    seqs: torch.Tensor  # [b] int64 positions in the batch
    rows: torch.Tensor  # [b, L] int64 their rows in the flat [T] batch
    recurrent: bool  # row by row (decode, verify, short runs) rather than chunked (prefill)
    keep: bool  # the state after each row into the scratch, the slot left as it was


@dataclass
class RecurrentBatch:
    """One forward's view of the recurrent state: which slot each sequence of the batch reads and writes.
    Sequences are in the order of the attention metadata's (PagedBatch.query_start)."""

    state: RecurrentState
    slots: torch.Tensor  # [B] int64 the state slot of each sequence (distinct)
    query_start: torch.Tensor  # [B + 1] int32 row offsets of each sequence in the flat [T] batch
    fresh: torch.Tensor  # [B] bool the sequence starts here (its first row is position 0): its state starts at zero
    keep_rows: torch.Tensor | None = None  # [B] bool verify blocks: per-row states kept, the slot untouched; None: none

    @classmethod
    def build(cls, state: RecurrentState, slots: torch.Tensor, query_start: torch.Tensor, positions: torch.Tensor,
              keep_rows: torch.Tensor | None = None) -> RecurrentBatch:
        """`fresh` from positions [T]: a sequence whose first row of this batch is position 0."""
        nonempty = query_start[1:] > query_start[:-1]
        if positions.shape[0] == 0:
            return cls(state, slots.long(), query_start, nonempty, keep_rows)
        first = query_start[:-1].long().clamp(max=positions.shape[0] - 1)
        fresh = (positions[first] == 0) & nonempty
        return cls(state, slots.long(), query_start, fresh, keep_rows)

    @classmethod
    def single(cls, shape: RecurrentShape, rows: int, dtype: torch.dtype, device: torch.device) -> RecurrentBatch:
        """One sequence from position 0 over `rows` rows, its state thrown away after (a whole-sequence forward)."""
        return cls(RecurrentState(shape, 1, dtype, device), torch.zeros(1, dtype=torch.long, device=device),
                   torch.tensor([0, rows], dtype=torch.int32, device=device),
                   torch.ones(1, dtype=torch.bool, device=device))

    @functools.cached_property
    def groups(self) -> list[SeqGroup]:
        """The batch's sequences grouped for the linear layers (host side, once per forward): keep_rows sequences
        and short runs together by row count, row by row; every longer run alone, chunked."""
        qs = self.query_start.tolist()
        keep = self.keep_rows.tolist() if self.keep_rows is not None else [False] * (len(qs) - 1)
        together: dict[tuple[int, bool], list[int]] = {}
        alone: list[int] = []
        for i in range(len(qs) - 1):
            n = qs[i + 1] - qs[i]
            if n > 0 and (keep[i] or n <= RECURRENT_MAX_ROWS):
                together.setdefault((n, keep[i]), []).append(i)
            elif n > 0:
                alone.append(i)
        dev = self.slots.device
        groups = []
        for (n, kept), seqs in together.items():
            starts = torch.tensor([qs[i] for i in seqs], device=dev)
            rows = starts[:, None] + torch.arange(n, device=dev)
            groups.append(SeqGroup(torch.tensor(seqs, device=dev), rows, True, kept))
        for i in alone:
            rows = torch.arange(qs[i], qs[i + 1], device=dev)[None]
            groups.append(SeqGroup(torch.tensor([i], device=dev), rows, False, False))
        return groups

    def initial(self, layer: int, group: SeqGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [b, conv_dim, K-1], delta-rule states [b, H, Dk, Dv]) the group's sequences start from:
        their slots', zeros for fresh ones (a slot's old contents are not read, even NaN)."""
        slots, fresh = self.slots[group.seqs], self.fresh[group.seqs]
        window = self.state.conv[layer].index_select(0, slots)
        ssm = self.state.ssm[layer].index_select(0, slots)
        return (torch.where(fresh[:, None, None], 0.0, window).to(window.dtype),
                torch.where(fresh[:, None, None, None], 0.0, ssm))

    def store(self, layer: int, group: SeqGroup, window: torch.Tensor, ssm: torch.Tensor) -> None:
        """The group's state after this forward: window [b, C, K-1] and ssm [b, H, Dk, Dv] into the slots, or, for
        a keep group, the per-row window [b, L, C, K-1] and ssm [b, L, H, Dk, Dv] into the scratch."""
        st = self.state
        if group.keep:
            n = group.rows.shape[1]
            if n > st.conv_rows.shape[2] or int(group.seqs.max()) >= st.conv_rows.shape[1]:
                raise ValueError(f"keep_rows for {n} rows at batch position {int(group.seqs.max())}: the state "
                                 f"keeps {st.conv_rows.shape[2]} rows of {st.conv_rows.shape[1]} sequences")
            st.conv_rows[layer][group.seqs, :n] = window.to(st.conv_rows.dtype)
            st.ssm_rows[layer][group.seqs, :n] = ssm
            return
        slots = self.slots[group.seqs]
        st.conv[layer].index_copy_(0, slots, window.to(st.conv.dtype))
        st.ssm[layer].index_copy_(0, slots, ssm)
