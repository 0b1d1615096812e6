"""The verification walk over training blocks: the engine's tau on a teacher-forced sequence, from training hits.

At inference a response is decoded block by block: the block at a accepts n drafts, emits n + 1 tokens, and the next
block starts at a + n + 1. Given the acceptance length of a block at every response position (the training forward
scores them all when every position is an anchor), walking those jumps from each response's first token visits
exactly the blocks the engine would verify on that text, so tokens / steps over them is its tau there. The average
over all anchors (`tau` in the training log) weighs easy stretches by their length instead of by the few steps spent
there and runs well above it. `walk` is the definition (host lists); `visited_blocks` computes the same set on the
device for a whole micro-batch."""

from __future__ import annotations

import torch

from blockspec.train.batches import MicroBatch


def walk(anchors: list[int], accepted: list[int], starts: list[int]) -> list[int]:
    """Indices into `anchors` of the blocks the walks from each start visit, in order, over one sequence's blocks
    (anchors with their accepted counts). A walk stops where no block is anchored (past the response, or an anchor
    not sampled)."""
    at = {a: i for i, a in enumerate(anchors)}
    visited: list[int] = []
    for a in starts:
        while a in at:
            visited.append(at[a])
            a += accepted[at[a]] + 1
    return visited


def visited_blocks(mb: MicroBatch, accepted: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    """[num_blocks] bool, on mb's device, no host sync: the real blocks of the micro-batch that the walks from the
    response starts visit, given each block's accepted count [num_blocks]. Pointer doubling: after round k the walks'
    first 2^(k+1) steps are marked, so ceil(log2(max_len)) + 1 rounds cover any response of at most max_len tokens."""
    N, T = mb.num_blocks, len(mb.seq_ids)
    first_row = slice(0, N * block_size, block_size)  # real blocks come first
    anchor, s, dev = mb.block_anchor[first_row], mb.block_seq[first_row], mb.seq_ids.device
    slot = (mb.seq_ids + 1).clamp(min=0)  # slot 0 collects padding tokens
    first = torch.full((T + 2,), T, dtype=torch.long, device=dev).scatter_reduce(
        0, slot, torch.arange(T, device=dev), "amin")[1:]  # first token index of each sequence
    length = torch.zeros(T + 2, dtype=torch.long, device=dev).scatter_reduce(0, slot, mb.positions + 1, "amax")[1:]
    block_at = torch.full((T + 1,), N, dtype=torch.long, device=dev)  # token index -> block anchored there (N: none)
    block_at[first[s] + anchor] = torch.arange(N, device=dev)
    target = anchor + accepted + 1
    nxt = torch.cat([torch.where(target < length[s], block_at[(first[s] + target).clamp(max=T)], N),
                     torch.tensor([N], device=dev)])  # [N + 1]; N is a sink that points to itself
    visited = torch.cat([mb.block_offset[first_row] == 0, torch.zeros(1, dtype=torch.bool, device=dev)]).long()
    for _ in range(max(1, max_len - 1).bit_length() + 1):
        visited = (visited + torch.zeros_like(visited).index_add_(0, nxt, visited)).clamp_(max=1)
        nxt = nxt[nxt]
    return visited[:N].bool()
