"""Who may attend to whom in a training micro-batch: one definition per attention, used three ways (dense boolean
masks for the SDPA path and the tests, the mask_mod of FlexAttention, and a tile-level superset for its block
sparsity).

Draft keys are [context of every sequence (T rows) ; block rows (Q rows)]. A block row r (sequence s, anchor a)
sees context keys of sequence s at positions < a (strict: x_a's own features do not exist yet at inference) and the
rows of its own block, never other blocks. On top of that the per-layer position rule of the inference mask
(torch_ref.build_mask) applies: causal layers see key positions <= their own, windowed layers only |diff| < W."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.train.batches import TILE


@dataclass
class DraftLayout:
    ctx_seq: torch.Tensor  # [T] sequence of each context key (padding: negative)
    ctx_pos: torch.Tensor  # [T]
    q_seq: torch.Tensor  # [Q] sequence of each block row (padding: -1)
    q_anchor: torch.Tensor  # [Q] anchor of each block row (padding: 0)
    q_pos: torch.Tensor  # [Q]
    block_size: int

    @property
    def num_ctx(self) -> int:
        return len(self.ctx_seq)

    def visible(self, q: torch.Tensor, kv: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
        """q: block-row indices, kv: key indices (broadcastable; elementwise, so it also serves as a mask_mod)."""
        T, B = self.num_ctx, self.block_size
        is_ctx = kv < T
        c = kv.clamp(max=T - 1)
        b = (kv - T).clamp(min=0)
        ok = torch.where(is_ctx, (self.ctx_seq[c] == self.q_seq[q]) & (self.ctx_pos[c] < self.q_anchor[q]),
                         b // B == q // B)
        if causal or window is not None:
            diff = self.q_pos[q] - torch.where(is_ctx, self.ctx_pos[c], self.q_pos[b])
            if causal:
                ok = ok & (diff >= 0)
            if window is not None:
                ok = ok & (diff.abs() < window)
        return ok

    def dense(self, causal: bool, window: int | None, rows: torch.Tensor | None = None,
              keys: torch.Tensor | None = None) -> torch.Tensor:
        """Boolean mask [rows, keys] (default: every row, every key)."""
        dev = self.q_pos.device
        rows = torch.arange(len(self.q_pos), device=dev) if rows is None else rows
        keys = torch.arange(self.num_ctx + len(self.q_pos), device=dev) if keys is None else keys
        return self.visible(rows[:, None], keys[None, :], causal, window)

    def tile_superset(self, num_seqs: int) -> torch.Tensor:
        """[Q/TILE, (T+Q)/TILE] bool: True for every tile pair holding a visible (row, key) (and possibly more).
        Rows are sorted by (sequence, anchor) and context keys by (sequence, position), so the context keys a tile
        of rows sees lie in [context start of its first row's sequence, max over its rows of start + anchor).
        No host synchronisation (the next micro-batch is prepared while the GPU works)."""
        T, Q, B = self.num_ctx, len(self.q_pos), self.block_size
        dev = self.q_pos.device
        real = self.q_seq >= 0
        # starts[s + 1] = index of the first context key of sequence s (slot 0 collects the padding)
        starts = torch.full((num_seqs + 1,), T, device=dev, dtype=torch.long).scatter_reduce(
            0, (self.ctx_seq + 1).clamp(min=0), torch.arange(T, device=dev), "amin")
        row_lo = torch.where(real, starts[self.q_seq + 1], T)
        row_hi = torch.where(real, row_lo + self.q_anchor, 0)
        lo = row_lo.view(-1, TILE).min(1).values
        hi = row_hi.view(-1, TILE).max(1).values
        j = torch.arange((T + Q) // TILE, device=dev)[None, :] * TILE  # first key of each key tile
        ctx = (j + TILE > lo[:, None]) & (j < hi[:, None])
        r0 = torch.arange(0, Q, TILE, device=dev)  # own block keys: whole blocks around the tile's rows
        blo = T + r0 // B * B
        bhi = T + ((r0 + TILE - 1) // B + 1) * B
        return ctx | ((j + TILE > blo[:, None]) & (j < bhi[:, None]))


@dataclass
class TargetLayout:
    seq_ids: torch.Tensor  # [T] (padding rows: a negative id of their own)
    positions: torch.Tensor  # [T]

    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Causal inside each sequence."""
        return (self.seq_ids[q] == self.seq_ids[kv]) & (self.positions[kv] <= self.positions[q])

    def tile_superset(self) -> torch.Tensor:
        """[T/TILE, T/TILE]: a row sees keys from its sequence's first token (index - position) to itself."""
        T = len(self.seq_ids)
        first = (torch.arange(T, device=self.seq_ids.device) - self.positions).view(-1, TILE).min(1).values
        j = torch.arange(0, T, TILE, device=self.seq_ids.device)[None, :]
        return (j + TILE > first[:, None]) & (j <= torch.arange(0, T, TILE, device=self.seq_ids.device)[:, None])
