"""Per-sequence recurrent state of hybrid models (Gated DeltaNet layers beside full attention: Qwen3.5 / Qwen3.6), the
model side of it: where the state lives, how one forward addresses it, and what a verify block keeps for its rollback.

A full-attention layer keeps its K/V in the paged pool, one row per token. A linear-attention layer keeps, per
sequence, a fixed-size state whatever the length: its conv window (the last K-1 inputs of its short convolution,
[conv_dim, K-1]) and its delta-rule state ([num_v_heads, k_dim, v_dim], fp32). Each running sequence owns a state
slot for its life; `RecurrentState` holds the slots of every linear layer, and a forward names each sequence's slot
in a `RecurrentBatch`, beside the attention metadata.

Rollback by replay. KV rows of rejected drafts are harmless (overwritten later, never read before), but a recurrent
state absorbs every row it is run over. So a verify block runs with `keep`: its outputs come from the slot's state
as usual, the slot is left as it was, and the block's per-row INPUTS to the recurrence go into a scratch at (batch
position, row): the conv inputs (q|k|v before the short conv) and each row's log decay g and write strength beta.
After acceptance (n drafts accepted: rows 0..n committed) the model's `commit_state` replays each verify block over
all its rows from the slot's state with g := 0 and beta := 0 on the rows past n (exp(0) = 1 and a zero write leave
the state unchanged, bit for bit), so the slot gets exactly the state after rows 0..n, and the conv window := the
K-1 inputs ending at row n, a gather (layers/short_conv.window_after). Fixed shapes whatever was accepted, no host
sync: the decode step captures it. A row costs C + 2 Hv numbers of scratch per layer, where a copy of the state
after each row would cost Hv x Dk x Dv fp32 (about 96 MiB a row on a 9B model, all layers).

What the engine does (engine/recurrent.py):
  1. allocate `RecurrentState(model.recurrent_shape(), num_slots, dtype, device, keep_seqs, keep_rows)` beside a
     KVPool of `model.kv_cache_shape()` (only full-attention layers have K/V); keep_seqs >= the largest verify
     batch, keep_rows >= K + 1;
  2. give each sequence a slot when it is admitted, free it when it finishes or is preempted (nothing to clear: a
     sequence whose first row is at position 0 starts from zeros, `fresh`, and its slot's old contents are never
     read); preemption is by recompute, from position 0;
  3. each forward: `RecurrentBatch.build(...)` (varlen: the host's row counts, so no device sync) or
     `RecurrentBatch.uniform(...)` (the decode step: B sequences of the same rows) -> model(..., state=...);
  4. after a verify step: `model.commit_state(batch, accepted)`.
Prefix-cache hits would need the state at the hit point, which is not kept: prefix caching is off for hybrids."""

from __future__ import annotations

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
        conv = self.conv_dim * (self.conv_kernel - 1) * _size(conv_dtype)
        return self.num_layers * (conv + self.num_v_heads * self.k_dim * self.v_dim * 4)

    def bytes_per_kept_row(self, conv_dtype: torch.dtype) -> int:
        """The replay scratch of one verify row, all layers: its conv inputs, g and beta."""
        return self.num_layers * (self.conv_dim * _size(conv_dtype) + 2 * self.num_v_heads * 4)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class RecurrentState:
    """Every linear layer's state slots, and the replay scratch of verify blocks."""

    def __init__(self, shape: RecurrentShape, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                 keep_seqs: int = 0, keep_rows: int = 0) -> None:
        L, C, W = shape.num_layers, shape.conv_dim, shape.conv_kernel - 1
        H, Dk, Dv = shape.num_v_heads, shape.k_dim, shape.v_dim
        self.shape = shape
        self.conv = torch.zeros(L, num_slots, C, W, dtype=dtype, device=device)  # in the activations' dtype
        self.ssm = torch.zeros(L, num_slots, H, Dk, Dv, dtype=torch.float32, device=device)  # fp32, as computed
        # a verify row's inputs to the recurrence, at (its sequence's batch position, row)
        self.x_rows = torch.zeros(L, keep_seqs, keep_rows, C, dtype=dtype, device=device)  # conv inputs
        self.g_rows = torch.zeros(L, keep_seqs, keep_rows, H, dtype=torch.float32, device=device)  # log decay
        self.beta_rows = torch.zeros(L, keep_seqs, keep_rows, H, dtype=torch.float32, device=device)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots dst <- slots src ([N] int64 each): a fork, or a snapshot kept for later."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def save(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of slots [N]'s conv windows and states (put back with restore)."""
        return self.conv[:, slots], self.ssm[:, slots]  # advanced indexing: copies

    def restore(self, slots: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv[:, slots] = saved[0]
        self.ssm[:, slots] = saved[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.conv, self.ssm, self.x_rows, self.g_rows, self.beta_rows))


@dataclass(frozen=True)
class SeqGroup:
    """Sequences of a batch computed together by a linear layer: the same row count and mode."""

    seqs: torch.Tensor  # [b] int64 positions in the batch
    rows: torch.Tensor | None  # [b, L] int64 their rows in the flat [T] batch; None: the whole batch in order (a view)
    length: int  # L, rows per sequence
    recurrent: bool  # row by row (decode, verify, short runs) rather than chunked (prefill)
    keep: bool  # a verify block: the rows' inputs into the scratch, the slot left as it was
    last_seq: int  # the largest batch position among seqs (host side: the scratch's bound is checked without a sync)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of a flat [T, ...] tensor -> [b, L, ...]."""
        return t.view(-1, self.length, *t.shape[1:]) if self.rows is None else t[self.rows]


@dataclass
class RecurrentBatch:
    """One forward's view of the recurrent state: which slot each sequence of the batch reads and writes, and how
    its sequences are grouped (decided on the host when the batch is built). Sequences are in the order of the
    attention metadata's (PagedBatch.query_start)."""

    state: RecurrentState
    slots: torch.Tensor  # [B] int64 the state slot of each sequence (distinct, but for padding rows' shared sink)
    fresh: torch.Tensor  # [B] bool the sequence starts here (its first row is position 0): its state starts at zero
    groups: list[SeqGroup]

    @classmethod
    def build(cls, state: RecurrentState, slots: torch.Tensor, query_start: torch.Tensor, positions: torch.Tensor,
              keep: list[bool] | None = None, host_query_start: list[int] | None = None) -> RecurrentBatch:
        """Any mix of sequences: query_start [B + 1] row offsets (host_query_start: the same on the host, else read
        from the device, a sync), positions [T]; keep: which sequences are verify blocks (None: none). Verify
        blocks and short runs go together by row count, row by row; every longer run alone, chunked."""
        qs = host_query_start if host_query_start is not None else query_start.tolist()
        B = len(qs) - 1
        keep = keep or [False] * B
        fresh = torch.zeros(B, dtype=torch.bool, device=slots.device)
        if positions.shape[0]:
            first = query_start[:-1].long().clamp(max=positions.shape[0] - 1)
            fresh = (positions[first] == 0) & (query_start[1:] > query_start[:-1])
        together: dict[tuple[int, bool], list[int]] = {}
        alone: list[int] = []
        for i in range(B):
            n = qs[i + 1] - qs[i]
            if n > 0 and (keep[i] or n <= RECURRENT_MAX_ROWS):
                together.setdefault((n, keep[i]), []).append(i)
            elif n > 0:
                alone.append(i)
        # every group's batch positions and rows, laid out on the host and copied to the device at once
        plan = [(seqs, n, True, kept) for (n, kept), seqs in together.items()]
        plan += [([i], qs[i + 1] - qs[i], False, False) for i in alone]
        flat = [v for seqs, n, _, _ in plan for v in seqs + [qs[i] + r for i in seqs for r in range(n)]]
        dev = torch.tensor(flat, dtype=torch.long).to(slots.device)
        groups, at = [], 0
        for seqs, n, recurrent, kept in plan:
            b = len(seqs)
            groups.append(SeqGroup(dev[at:at + b], dev[at + b:at + b + b * n].view(b, n), n, recurrent, kept,
                                   max(seqs)))
            at += b + b * n
        return cls(state, slots.long(), fresh, groups)

    @classmethod
    def uniform(cls, state: RecurrentState, slots: torch.Tensor, rows: int, first_positions: torch.Tensor,
                keep: bool) -> RecurrentBatch:
        """B sequences of `rows` rows each, back to back (the decode step): one group, row by row, no host-side
        grouping, static shapes. first_positions [B]: each sequence's first row's position (0: fresh)."""
        B = slots.shape[0]
        group = SeqGroup(torch.arange(B, device=slots.device), None, rows, True, keep, B - 1)
        return cls(state, slots.long(), first_positions == 0, [group])

    @classmethod
    def single(cls, shape: RecurrentShape, rows: int, dtype: torch.dtype, device: torch.device) -> RecurrentBatch:
        """One sequence from position 0 over `rows` rows, its state thrown away after (a whole-sequence forward)."""
        state = RecurrentState(shape, 1, dtype, device)
        qs = torch.tensor([0, rows], dtype=torch.int32, device=device)
        return cls.build(state, torch.zeros(1, dtype=torch.long, device=device), qs,
                         torch.zeros(min(rows, 1), dtype=torch.long, device=device), host_query_start=[0, rows])

    @property
    def keeps(self) -> bool:
        """Whether any sequence is a verify block (commit_state has something to do)."""
        return any(g.keep for g in self.groups)

    def _pick(self, t: torch.Tensor, group: SeqGroup) -> torch.Tensor:
        return t if group.rows is None else t[group.seqs]

    def initial(self, layer: int, group: SeqGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [b, conv_dim, K-1], delta-rule states [b, H, Dk, Dv]) the group's sequences start from:
        their slots', zeros for fresh ones (a slot's old contents are not read, even NaN)."""
        slots, fresh = self._pick(self.slots, group), self._pick(self.fresh, group)
        window = self.state.conv[layer].index_select(0, slots)
        ssm = self.state.ssm[layer].index_select(0, slots)
        return (torch.where(fresh[:, None, None], 0.0, window).to(window.dtype),
                torch.where(fresh[:, None, None, None], 0.0, ssm))

    def store(self, layer: int, group: SeqGroup, window: torch.Tensor, ssm: torch.Tensor) -> None:
        """The group's state: window [b, C, K-1] and ssm [b, H, Dk, Dv] into its slots."""
        st, slots = self.state, self._pick(self.slots, group)
        st.conv[layer].index_copy_(0, slots, window.to(st.conv.dtype))
        st.ssm[layer].index_copy_(0, slots, ssm)

    def keep_inputs(self, layer: int, group: SeqGroup, x: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """A verify group's rows' inputs into the scratch: x [b, L, C] conv inputs, g and beta [b, L, H]."""
        st, L = self.state, group.length
        if L > st.x_rows.shape[2] or group.last_seq >= st.x_rows.shape[1]:
            raise ValueError(f"a verify block of {L} rows at batch position {group.last_seq}: the state keeps "
                             f"{st.x_rows.shape[2]} rows of {st.x_rows.shape[1]} sequences")
        for rows, value in ((st.x_rows, x.to(st.x_rows.dtype)), (st.g_rows, g), (st.beta_rows, beta)):
            if group.rows is None:
                rows[layer, :value.shape[0], :L] = value
            else:
                rows[layer][group.seqs, :L] = value

    def kept_inputs(self, layer: int, group: SeqGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What keep_inputs stored for the group: (x [b, L, C], g [b, L, H], beta [b, L, H])."""
        st, L = self.state, group.length
        if group.rows is None:
            b = self.slots.shape[0]
            return st.x_rows[layer, :b, :L], st.g_rows[layer, :b, :L], st.beta_rows[layer, :b, :L]
        return st.x_rows[layer][group.seqs, :L], st.g_rows[layer][group.seqs, :L], st.beta_rows[layer][group.seqs, :L]
