"""Training micro-batches: whole sequences packed flat for one frozen target pass, plus their draft blocks.

Every random choice (the epoch's sequence order, each micro-batch's anchors) comes from a generator seeded by
(seed, epoch, micro-batch index), so a resumed run sees exactly the batches of an uninterrupted one."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockspec.data.shards import TokenSequence
from blockspec.train.anchors import response_starts, sample_anchors

TILE = 128  # FlexAttention's sparse block: padded lengths are multiples of it


def generator(seed: int, *keys: int) -> torch.Generator:
    mixed = seed
    for k in keys:
        mixed = (mixed * 1_000_003 + k + 1) % (1 << 62)
    return torch.Generator().manual_seed(mixed)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Capacity:
    """Per micro-batch limits: target tokens and anchor blocks. With pad=True (compiled FlexAttention on CUDA)
    every micro-batch is padded to exactly these sizes, so nothing is ever recompiled."""

    tokens: int
    anchors: int
    block_size: int
    pad: bool

    @property
    def rows(self) -> int:
        """Block rows of a padded micro-batch: a multiple of the tile and of B (whole blocks, padding included:
        DFlash 2's convolutions run block by block)."""
        return round_up(self.anchors * self.block_size, math.lcm(TILE, self.block_size))


@dataclass
class MicroBatch:
    # the frozen target pass over whole sequences, back to back (T = real tokens, or capacity.tokens when padded)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position inside its own sequence
    seq_ids: torch.Tensor  # [T] int64, sequence index in this batch; padding rows -1-i (each alone)
    seq_lens: list[int]  # real sequences only
    # draft blocks, sequence by sequence, anchors ascending (Q = num_blocks * B, or capacity.rows when padded)
    block_ids: torch.Tensor  # [Q] int64: x_a at slot 0, mask_token_id elsewhere
    block_pos: torch.Tensor  # [Q] int64: a + slot
    block_seq: torch.Tensor  # [Q] int64: sequence index; padding -1
    block_anchor: torch.Tensor  # [Q] int64: a; padding 0 (sees no context)
    # [Q] int64: a minus the first position of a's response; 0 where a verification walk starts
    block_offset: torch.Tensor
    labels: torch.Tensor  # [Q] int64: x_{a+slot} (0 where unused)
    # [Q] int64: index into the packed tokens of the target position that predicts the label (a + slot - 1), for
    # distillation; 0 where unused. Built here on the host so the loss needs no host-to-device copy of its own.
    label_src: torch.Tensor
    weights: torch.Tensor  # [Q] float32: slot weight where the label is a response token, else 0
    loss_rows: torch.Tensor  # [R] int64: the rows with weight > 0, the only ones sent through the lm_head
    blocks_per_seq: list[int]
    num_tokens: int  # real target tokens
    num_blocks: int  # real blocks

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})


def plan_epoch(lengths: list[int], anchors: list[int], cap: Capacity, gen: torch.Generator,
               open_bins: int = 32) -> list[list[int]]:
    """Sequence indices of each micro-batch of one epoch: a random order, packed first-fit (among the most recent
    `open_bins` unfilled micro-batches) under the token and anchor limits."""
    bins: list[list[int]] = []
    room: list[list[int]] = []  # [tokens left, anchors left] of each open bin
    open_ids: list[int] = []
    for i in torch.randperm(len(lengths), generator=gen).tolist():
        for b in open_ids:
            if room[b][0] >= lengths[i] and room[b][1] >= anchors[i]:
                break
        else:
            b = len(bins)
            bins.append([])
            room.append([cap.tokens, cap.anchors])
            open_ids.append(b)
            if len(open_ids) > open_bins:
                open_ids.pop(0)
        bins[b].append(i)
        room[b][0] -= lengths[i]
        room[b][1] -= anchors[i]
    return bins


def build_micro_batch(seqs: list[TokenSequence], cap: Capacity, num_anchors: int, mask_token_id: int,
                      slot_w: torch.Tensor, gen: torch.Generator) -> MicroBatch:
    """seqs: the micro-batch's sequences (already cut to the maximum length). slot_w: [B] from slot_weights."""
    B = cap.block_size
    slot = torch.arange(B)
    ids, pos, sid = [], [], []
    bpos, bseq, banchor, boff, labels, src, weights, first = [], [], [], [], [], [], [], []
    offset = 0  # of this sequence in the packed tokens
    for s, seq in enumerate(seqs):
        L = len(seq.input_ids)
        ids.append(seq.input_ids)
        pos.append(torch.arange(L))
        sid.append(torch.full((L,), s))
        a = sample_anchors(seq.loss_mask, num_anchors, gen)
        at = a[:, None] + slot[None]  # [n, B]; rows past the sequence's end have no label
        inside = at < L
        at_in = at.clamp(max=L - 1)
        first.append(seq.input_ids[a])
        bpos.append(at.flatten())
        bseq.append(torch.full((len(a) * B,), s))
        banchor.append(a.repeat_interleave(B))
        starts = torch.tensor(response_starts(seq.loss_mask), dtype=a.dtype)
        boff.append((a - starts[torch.searchsorted(starts, a, right=True) - 1]).repeat_interleave(B))
        labels.append(torch.where(inside, seq.input_ids[at_in], 0).flatten())
        src.append(torch.where(inside, offset + at - 1, 0).clamp(min=0).flatten())
        offset += L
        # a block ends at its first non-response label: slots past a user turn would ask the drafter to predict
        # the next answer from context that precedes that turn, which inference never does
        weights.append(((seq.loss_mask[at_in] & inside).long().cumprod(1) * slot_w[None]).flatten())
    n_blocks = sum(len(f) for f in first)
    block_ids = torch.full((n_blocks, B), mask_token_id)
    block_ids[:, 0] = torch.cat(first)
    w = torch.cat(weights).float()
    mb = MicroBatch(
        torch.cat(ids), torch.cat(pos), torch.cat(sid), [len(s.input_ids) for s in seqs],
        block_ids.flatten(), torch.cat(bpos), torch.cat(bseq), torch.cat(banchor), torch.cat(boff),
        torch.cat(labels), torch.cat(src), w,
        torch.nonzero(w > 0).flatten(), [len(f) for f in first], sum(len(s.input_ids) for s in seqs), n_blocks,
    )
    return _pad(mb, cap, mask_token_id) if cap.pad else mb


def _pad(mb: MicroBatch, cap: Capacity, mask_token_id: int) -> MicroBatch:
    T, Q = len(mb.input_ids), len(mb.block_ids)
    pt, pq = round_up(cap.tokens, TILE) - T, cap.rows - Q

    def ext(t: torch.Tensor, n: int, value: float | torch.Tensor) -> torch.Tensor:
        fill = value if isinstance(value, torch.Tensor) else torch.full((n,), value, dtype=t.dtype)
        return torch.cat([t, fill.to(t.dtype)])

    return MicroBatch(
        ext(mb.input_ids, pt, 0), ext(mb.positions, pt, 0), ext(mb.seq_ids, pt, -1 - torch.arange(T, T + pt)),
        mb.seq_lens, ext(mb.block_ids, pq, mask_token_id), ext(mb.block_pos, pq, 0), ext(mb.block_seq, pq, -1),
        # block_offset 1: padding rows start no verification walk
        ext(mb.block_anchor, pq, 0), ext(mb.block_offset, pq, 1), ext(mb.labels, pq, 0), ext(mb.label_src, pq, 0),
        ext(mb.weights, pq, 0.0),
        mb.loss_rows, mb.blocks_per_seq, mb.num_tokens, mb.num_blocks,
    )
