"""The verification walk over training blocks: the engine's tau on a teacher-forced sequence, from training hits.

At inference a response is decoded block by block: the block at a accepts n drafts, emits n + 1 tokens, and the next
block starts at a + n + 1. Given the acceptance length of a block at every response position (the training forward
scores them all when every position is an anchor), walking those jumps from each response's first token visits
exactly the blocks the engine would verify on that text, so tokens / steps is its tau there. The average over all
anchors (`tau` in the training log) weighs easy stretches by their length instead of by the few steps spent there
and runs well above it."""

from __future__ import annotations

import torch


def walk(anchors: list[int], accepted: list[int], starts: list[int]) -> list[int]:
    """Tokens emitted per step (n + 1) of the walks from each start, over one sequence's blocks (anchors with their
    accepted counts). A walk stops where no block is anchored (past the response, or an anchor not sampled)."""
    at = dict(zip(anchors, accepted))
    steps: list[int] = []
    for a in starts:
        while a in at:
            steps.append(at[a] + 1)
            a += steps[-1]
    return steps


def response_starts(loss_mask: torch.Tensor) -> list[int]:
    """First position of every response segment."""
    prev = torch.cat([torch.zeros(1, dtype=torch.bool), loss_mask[:-1]])
    return torch.nonzero(loss_mask & ~prev).flatten().tolist()


def visited_blocks(anchor: torch.Tensor, seq: torch.Tensor, accepted: torch.Tensor, is_start: torch.Tensor,
                   seq_ids: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """[N] bool on the device, no host sync: the blocks the walk visits from the response starts, in a micro-batch.
    anchor, seq, accepted, is_start [N] per block (padding blocks: seq < 0); seq_ids, positions [T] per packed
    token (train/batches.MicroBatch). Pointer doubling: after round k the walk's first 2^(k+1) steps are marked,
    so ceil(log2(max_len)) + 1 rounds cover any response of at most max_len tokens."""
    N, T, dev = len(anchor), len(seq_ids), anchor.device
    real = seq >= 0
    s = seq.clamp(min=0)
    slot = (seq_ids + 1).clamp(min=0)  # slot 0 collects padding tokens
    first = torch.full((T + 2,), T, dtype=torch.long, device=dev).scatter_reduce(
        0, slot, torch.arange(T, device=dev), "amin")[1:]  # first token index of each sequence
    length = torch.zeros(T + 2, dtype=torch.long, device=dev).scatter_reduce(0, slot, positions + 1, "amax")[1:]
    block_at = torch.full((T + 1,), N, dtype=torch.long, device=dev)  # token index -> block anchored there (N: none)
    block_at[torch.where(real, first[s] + anchor, T)] = torch.arange(N, device=dev)
    block_at[T] = N
    target = anchor + accepted + 1
    nxt = torch.cat([torch.where(real & (target < length[s]), block_at[(first[s] + target).clamp(max=T)], N),
                     torch.tensor([N], device=dev)])  # [N + 1], N is a sink that points to itself
    visited = torch.cat([is_start & real, torch.zeros(1, dtype=torch.bool, device=dev)]).long()
    for _ in range(max(1, max_len - 1).bit_length() + 1):
        visited = (visited + torch.zeros_like(visited).index_add_(0, nxt, visited)).clamp_(max=1)
        nxt = nxt[nxt]
    return visited[:N].bool()
