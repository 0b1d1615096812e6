"""Attention for training micro-batches: the packed causal target pass (AttentionFn) and the many-blocks draft pass
(DraftAttentionFn), each either exact SDPA with boolean masks, one sequence at a time (CPU, tests, fallback), or
FlexAttention over the whole padded micro-batch (CUDA). Both take their masks from train/masks.py."""

from __future__ import annotations

from typing import Callable

import torch

from blockspec.attention.torch_ref import attend, build_mask
from blockspec.models.base import AttentionBase
from blockspec.train.batches import TILE, Capacity, MicroBatch, round_up
from blockspec.train.masks import DraftLayout, TargetLayout

LayerKind = tuple[bool, "int | None"]  # (causal, window) of a draft layer


def draft_layout(mb: MicroBatch, block_size: int) -> DraftLayout:
    return DraftLayout(mb.seq_ids, mb.positions, mb.block_seq, mb.block_anchor, mb.block_pos, block_size)


def _block_mask(tiles: torch.Tensor, mask_mod: Callable, q_len: int, kv_len: int):
    """BlockMask from a [q_tiles, kv_tiles] superset of the visible tiles; mask_mod makes it exact inside them."""
    from torch.nn.attention.flex_attention import BlockMask

    counts = tiles.sum(1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(counts[None, None], order[None, None], BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


class FlexState:
    """FlexAttention for padded micro-batches of one fixed size. The masks read persistent buffers that each
    micro-batch overwrites in place, so the mask_mod functions, and with them the compiled kernels, never change."""

    def __init__(self, cap: Capacity, kinds: list[LayerKind], device: torch.device, compiled: bool = True) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        T, Q = round_up(cap.tokens, TILE), cap.rows
        z = lambda n: torch.zeros(n, dtype=torch.long, device=device)  # noqa: E731
        self.target = TargetLayout(z(T), z(T))
        self.draft = DraftLayout(z(T), z(T), z(Q), z(Q), z(Q), cap.block_size)
        self.target_mod = lambda b, h, q, kv: self.target.visible(q, kv)
        self.draft_mods = {kind: self._draft_mod(*kind) for kind in kinds}
        self.flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def _draft_mod(self, causal: bool, window: int | None) -> Callable:
        return lambda b, h, q, kv: self.draft.visible(q, kv, causal, window)

    def load(self, mb: MicroBatch) -> tuple[object, dict[LayerKind, object]]:
        """Copy the micro-batch's layout into the buffers; (target BlockMask, draft BlockMask per layer kind)."""
        t, d = self.target, self.draft
        for buf, src in ((t.seq_ids, mb.seq_ids), (t.positions, mb.positions), (d.ctx_seq, mb.seq_ids),
                         (d.ctx_pos, mb.positions), (d.q_seq, mb.block_seq), (d.q_anchor, mb.block_anchor),
                         (d.q_pos, mb.block_pos)):
            buf.copy_(src)
        T, Q = len(t.seq_ids), len(d.q_seq)
        target = _block_mask(t.tile_superset(), self.target_mod, T, T)
        tiles = d.tile_superset(len(mb.seq_lens))
        return target, {kind: _block_mask(tiles, mod, Q, T + Q) for kind, mod in self.draft_mods.items()}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float) -> torch.Tensor:
        """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D]."""
        out = self.flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                        block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)


class PackedCausalAttention(AttentionBase):
    """AttentionFn of the frozen target over whole packed sequences: causal inside each sequence, nothing across; per
    call what the layer asks, with the paged attention's keywords (attention/paged_ref.py): `window` W (keys in
    (p - W, p] only), `sinks` [Hq] (learned attention sinks), and k = v = None (a layer reading an earlier layer's
    K/V: `shared` names the layers whose K/V are kept for that, train/target_pass.shared_kv_layers). FlexAttention
    takes the plain causal layers; a windowed or sink layer runs the exact per-sequence SDPA path (its masks built
    once per micro-batch and window), padding rows left zero."""

    def __init__(self, mb: MicroBatch, flex: FlexState | None = None, block_mask=None,
                 shared: frozenset[int] = frozenset()) -> None:
        self.mb, self.flex, self.block_mask, self.shared = mb, flex, block_mask, shared
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        bounds = torch.tensor([0] + mb.seq_lens).cumsum(0).tolist()
        self.spans = list(zip(bounds, bounds[1:]))
        self._masks: dict[int | None, list[torch.Tensor]] = {}

    def masks(self, window: int | None = None) -> list[torch.Tensor]:
        if window not in self._masks:
            pos = self.mb.positions
            self._masks[window] = [build_mask(pos[a:b], pos[a:b], True, window) for a, b in self.spans]
        return self._masks[window]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, scale: float,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if k is None or v is None:
            k, v = self.kept[layer]
        elif layer in self.shared:
            self.kept[layer] = (k, v)
        if self.flex is not None and window is None and sinks is None:
            return self.flex.attend(q, k, v, self.block_mask, scale)
        out = torch.zeros_like(q)  # padding rows: finite (their keys are masked, but NaN * 0 is NaN)
        for (a, b), mask in zip(self.spans, self.masks(window)):
            out[a:b] = attend(q[a:b], k[a:b], v[a:b], mask, scale, sinks)
        return out


class BlockTrainingAttention:
    """DraftAttentionFn for every block of a micro-batch at once. ctx_kv: per draft layer (k, v) [T, Hkv, D] of the
    micro-batch's context (model.context_kv, with grad); the block's own k/v arrive per call."""

    def __init__(self, mb: MicroBatch, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 dtype: torch.dtype, flex: FlexState | None = None, block_masks: dict | None = None) -> None:
        self.ctx_kv, self.dtype, self.flex, self.block_masks = ctx_kv, dtype, flex, block_masks
        if flex is None:
            self.layout = draft_layout(mb, block_size)
            t = torch.tensor([0] + mb.seq_lens).cumsum(0).tolist()
            r = (torch.tensor([0] + mb.blocks_per_seq).cumsum(0) * block_size).tolist()
            self.spans = list(zip(t, t[1:], r, r[1:]))
            self._masks: dict[LayerKind, list[torch.Tensor]] = {}

    def _sdpa_masks(self, kind: LayerKind) -> list[torch.Tensor]:
        if kind not in self._masks:
            dev, T = self.layout.q_pos.device, self.layout.num_ctx
            self._masks[kind] = [
                self.layout.dense(*kind, torch.arange(r0, r1, device=dev),
                                  torch.cat([torch.arange(t0, t1, device=dev), T + torch.arange(r0, r1, device=dev)]))
                for t0, t1, r0, r1 in self.spans
            ]
        return self._masks[kind]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 window: int | None) -> torch.Tensor:
        ck, cv = self.ctx_kv[layer]
        q, k, v, ck, cv = (x.to(self.dtype) for x in (q, k, v, ck, cv))
        if self.flex is not None:
            return self.flex.attend(q, torch.cat([ck, k]), torch.cat([cv, v]), self.block_masks[(causal, window)], scale)
        out = torch.empty_like(q)
        for (t0, t1, r0, r1), mask in zip(self.spans, self._sdpa_masks((causal, window))):
            out[r0:r1] = attend(q[r0:r1], torch.cat([ck[t0:t1], k[r0:r1]]), torch.cat([cv[t0:t1], v[r0:r1]]), mask, scale)
        return out
