"""Token shards: the on-disk format of drafter training data (written by the data builder, read by the trainer).

A dataset directory holds `manifest.json` and `shard-NNNNN.safetensors` files. Each shard concatenates whole
sequences (prompt + target-regenerated response, chat template applied):
    input_ids    int32 [N]      token ids of every sequence, back to back
    loss_mask    uint8 [N]      1 on response tokens (the only positions a draft block may be anchored in / labelled by)
    seq_offsets  int64 [S + 1]  sequence s is input_ids[seq_offsets[s]:seq_offsets[s + 1]]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file, save_file

from blockspec.errors import BlockspecError

FORMAT = "blockspec-draft-data/1"
MANIFEST = "manifest.json"


@dataclass
class TokenSequence:
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool, True on response tokens


@dataclass
class Manifest:
    num_sequences: int
    num_tokens: int
    num_response_tokens: int
    shards: list[str]
    meta: dict[str, Any] = field(default_factory=dict)  # target, prompt files, generation params, exclusions, ...


def write_shards(seqs: Iterable[TokenSequence], out_dir: str | Path, meta: dict[str, Any] | None = None,
                 tokens_per_shard: int = 1 << 24) -> Manifest:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[str] = []
    ids: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    totals = {"seqs": 0, "tokens": 0, "response": 0}

    def flush() -> None:
        if not ids:
            return
        lens = torch.tensor([0] + [len(t) for t in ids], dtype=torch.int64)
        name = f"shard-{len(shards):05d}.safetensors"
        save_file({"input_ids": torch.cat(ids).to(torch.int32), "loss_mask": torch.cat(masks).to(torch.uint8),
                   "seq_offsets": lens.cumsum(0)}, str(out / name))
        shards.append(name)
        ids.clear()
        masks.clear()

    pending = 0
    for s in seqs:
        if s.input_ids.shape != s.loss_mask.shape:
            raise BlockspecError(f"token sequence {totals['seqs']}: input_ids {tuple(s.input_ids.shape)} and "
                                 f"loss_mask {tuple(s.loss_mask.shape)} differ in shape")
        ids.append(s.input_ids)
        masks.append(s.loss_mask)
        totals["seqs"] += 1
        totals["tokens"] += len(s.input_ids)
        totals["response"] += int(s.loss_mask.sum())
        pending += len(s.input_ids)
        if pending >= tokens_per_shard:
            flush()
            pending = 0
    flush()
    manifest = Manifest(totals["seqs"], totals["tokens"], totals["response"], shards, dict(meta or {}))
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT, **manifest.__dict__}, indent=1))
    return manifest


def read_manifest(data_dir: str | Path) -> Manifest:
    path = Path(data_dir) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise BlockspecError(f"{path}: not found: {data_dir} is not a blockspec training-data directory") from None
    except json.JSONDecodeError as e:
        raise BlockspecError(f"{path}: invalid JSON ({e})") from None
    if raw.get("format") != FORMAT:
        raise BlockspecError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}")
    return Manifest(raw["num_sequences"], raw["num_tokens"], raw["num_response_tokens"], raw["shards"], raw.get("meta", {}))


def read_shards(data_dir: str | Path) -> list[TokenSequence]:
    manifest = read_manifest(data_dir)
    seqs: list[TokenSequence] = []
    for name in manifest.shards:
        path = Path(data_dir) / name
        try:
            t = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
            raise BlockspecError(f"{path}: cannot read shard ({e})") from None
        off = t["seq_offsets"].tolist()
        ids, mask = t["input_ids"].long(), t["loss_mask"].bool()
        seqs += [TokenSequence(ids[a:b], mask[a:b]) for a, b in zip(off, off[1:])]
    if len(seqs) != manifest.num_sequences:
        raise BlockspecError(f"{data_dir}: manifest lists {manifest.num_sequences} sequences, shards hold {len(seqs)}")
    return seqs
