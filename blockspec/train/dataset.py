"""Token shards -> the sequences a run trains on, the micro-batch capacity, and each epoch's plan of micro-batches."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from blockspec.data.shards import TokenSequence
from blockspec.errors import BlockspecError
from blockspec.train.anchors import num_anchors_of
from blockspec.train.batches import TILE, Capacity, generator, plan_epoch, round_up
from blockspec.train.config import TrainConfig


@dataclass
class TrainingSet:
    seqs: list[TokenSequence]  # cut to max_seq_len; each has at least one eligible anchor
    anchors: list[int]  # anchor blocks drawn from each sequence per epoch
    num_dropped: int  # sequences without any eligible anchor (response shorter than a block)
    num_cut: int  # sequences longer than max_seq_len

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.seqs)

    def fingerprint(self) -> dict[str, int | str]:
        """Counts and a digest of every sequence's tokens and loss mask, in order: ranks training together must
        hold the same sequences (each plans every step from all of them)."""
        digest = hashlib.sha256()
        for s in self.seqs:
            digest.update(len(s.input_ids).to_bytes(8, "little"))
            digest.update(s.input_ids.numpy().tobytes())
            digest.update(s.loss_mask.numpy().tobytes())
        return {"sequences": len(self.seqs), "tokens": self.num_tokens, "sha256": digest.hexdigest()[:16]}


def prepare(seqs: list[TokenSequence], cfg: TrainConfig, where: str) -> TrainingSet:
    kept, anchors, dropped, cut = [], [], 0, 0
    for s in seqs:
        if len(s.input_ids) > cfg.max_seq_len:
            s = TokenSequence(s.input_ids[: cfg.max_seq_len], s.loss_mask[: cfg.max_seq_len])
            cut += 1
        n = num_anchors_of(s.loss_mask, cfg.num_anchors)
        if n == 0:
            dropped += 1
            continue
        kept.append(s)
        anchors.append(n)
    if not kept:
        raise BlockspecError(f"{where}: no usable training sequence: each needs two consecutive response "
                             f"(loss_mask) tokens within --max-seq-len {cfg.max_seq_len}; {dropped} of {len(seqs)} "
                             f"sequences have none")
    return TrainingSet(kept, anchors, dropped, cut)


def capacity(data: TrainingSet, cfg: TrainConfig, block_size: int, pad: bool) -> Capacity:
    """Anchor blocks per micro-batch from the config; target tokens from the config, or, by default, sized so that
    an average micro-batch fills both limits together (10% slack), and never below the longest sequence."""
    tokens = cfg.batch_tokens
    if tokens is None:
        per_anchor = data.num_tokens / sum(data.anchors)
        longest = max(len(s.input_ids) for s in data.seqs)
        tokens = round_up(max(longest, math.ceil(cfg.batch_anchors * per_anchor * 1.1)), TILE)
    return Capacity(tokens, cfg.batch_anchors, block_size, pad)


def plan_epochs(data: TrainingSet, cap: Capacity, cfg: TrainConfig) -> list[list[list[int]]]:
    lengths = [len(s.input_ids) for s in data.seqs]
    return [plan_epoch(lengths, data.anchors, cap, generator(cfg.seed, 0, e)) for e in range(cfg.epochs)]
