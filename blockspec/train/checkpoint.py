"""checkpoint.pt: everything needed to continue a training run exactly where it stopped.

The data order and every anchor are functions of (seed, epoch, micro-batch index) (train/batches.py), so the
position (epoch, next micro-batch) together with the model, optimizer and scheduler states is the whole state."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockspec.errors import BlockspecError
from blockspec.train.config import TRAJECTORY_FIELDS, TrainConfig

NAME = "checkpoint.pt"


@dataclass
class Progress:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch of the next micro-batch
    micro: int = 0  # index of the next micro-batch in that epoch's plan
    tokens: int = 0  # real target tokens trained on
    blocks: int = 0  # anchor blocks trained on
    train_time_s: float = 0.0
    eval_time_s: float = 0.0
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "tau", ...} per evaluation
    last_log: dict[str, Any] | None = None  # the latest logged window (loss, accuracy per slot)


def save_checkpoint(out_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    progress: Progress, cfg: TrainConfig, draft_config: dict[str, Any],
                    data_key: dict[str, int]) -> Path:
    path = out_dir / NAME
    tmp = out_dir / (NAME + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "progress": asdict(progress), "train_config": cfg.to_dict(), "draft_config": draft_config,
                "data": data_key}, tmp)
    os.replace(tmp, path)  # a crash while writing never leaves a half checkpoint behind
    return path


def load_checkpoint(out_dir: Path, cfg: TrainConfig, draft_config: dict[str, Any], data_key: dict[str, int],
                    device: torch.device) -> dict[str, Any]:
    """The saved states, after checking that they belong to this run (same drafter, same trajectory settings, same
    training sequences by count; data_key {"sequences", "tokens"})."""
    path = out_dir / NAME
    if not path.is_file():
        raise BlockspecError(f"--resume: {path} does not exist (nothing to resume in {out_dir})")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a damaged file
        raise BlockspecError(f"{path}: cannot read checkpoint ({e})") from None
    if any(k.endswith("self_attn.q_proj.weight") for k in ckpt["model"]):  # before q/k/v became one qkv_proj
        raise BlockspecError(f"{path}: written by an earlier blockspec whose drafter kept q_proj/k_proj/v_proj apart "
                             f"(its optimizer state cannot be mapped onto the packed qkv_proj); continue from the "
                             f"run's export instead: --init {out_dir}")
    if ckpt["draft_config"] != draft_config:
        raise BlockspecError(f"{path}: the checkpoint is for a different drafter (draft config differs); resume with "
                             f"the same --draft-layers/--draft-block-size/--target-layer-ids/--intermediate-size/--init")
    # a setting added after the checkpoint was written had its default in that run
    saved = {**TrainConfig().to_dict(), **ckpt["train_config"]}
    changed = [f"{k} ({saved.get(k)!r} -> {v!r})" for k, v in cfg.to_dict().items()
               if k in TRAJECTORY_FIELDS and saved.get(k) != v]
    if changed:
        raise BlockspecError(f"{path}: cannot resume with changed settings: {', '.join(changed)}")
    saved_data = ckpt.get("data")  # absent in checkpoints written before it was recorded
    if saved_data is not None and saved_data != data_key:
        raise BlockspecError(f"{path}: cannot resume on other data: the checkpoint trained on "
                             f"{saved_data['sequences']} sequences / {saved_data['tokens']} tokens, this run has "
                             f"{data_key['sequences']} / {data_key['tokens']} (pass the same --data directories in "
                             f"the same order)")
    ckpt["progress"] = Progress(**ckpt["progress"])
    return ckpt
