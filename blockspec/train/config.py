"""TrainConfig: the drafter-training hyper-parameters (defaults from the DFlash paper, DFLASH.md section 5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from blockspec.errors import ConfigError

# Fields that fix the sequence of batches and updates: a checkpoint resumes only under the same values.
TRAJECTORY_FIELDS = ("num_anchors", "epochs", "lr", "weight_decay", "warmup_ratio", "grad_clip", "grad_accum",
                     "batch_anchors", "batch_tokens", "max_seq_len", "seed", "loss_gamma", "attention", "val_fraction",
                     "walk_weight", "distill_weight", "prefix_weight", "opening_weight", "opening_tokens")


@dataclass
class TrainConfig:
    num_anchors: int = 512  # anchor blocks per sequence (at most)
    epochs: int = 6
    lr: float = 6e-4
    # Mild decoupled decay on weight matrices only: the drafter sees a few million tokens for several epochs, and
    # norm gains (multiplicative scales starting at 1) must not be pulled towards 0.
    weight_decay: float = 0.01
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    grad_accum: int = 1
    batch_anchors: int = 4096  # anchor blocks per micro-batch (B rows each): the unit of draft compute
    batch_tokens: int | None = None  # target tokens per micro-batch; None: sized from the data's tokens per anchor
    max_seq_len: int = 3072  # longer sequences are cut to their first max_seq_len tokens
    seed: int = 0
    loss_gamma: float | None = None  # None: the paper's value for the block size (anchors.default_gamma)
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule still spans every epoch)
    # stop (checkpoint + export, as at the end) at the first step after this many minutes of train(): for jobs with
    # a wall-clock limit; --resume continues the same schedule
    time_limit_min: float | None = None
    save_every: int = 500  # optimizer steps between checkpoints (and at the end)
    eval_every: int = 1000  # optimizer steps between tau evaluations (0: only at the end)
    eval_max_tokens: int = 256
    log_every: int = 10  # optimizer steps per line of train_log.jsonl
    attention: str = "auto"  # flex | sdpa | auto (flex on CUDA, sdpa on CPU)
    val_fraction: float = 0.0  # sequences held out of training, scored at every evaluation (train/validate.py)
    walk_weight: float = 0.0  # extra loss weight of the blocks a verification walk visits (train/walk.py); 0: off
    # labels mixed with the target's own next-token distribution: (1 - w) onehot + w p_target (train/loss.py); 0: off
    distill_weight: float = 0.0
    # a slot's loss x (1 - p) unless the drafter hit every earlier slot of its block, where verification would reach
    # it (train/forward.py); 0: off
    prefix_weight: float = 0.0
    # extra loss weight of the blocks anchored in a response's first opening_tokens tokens (train/forward.py); 0: off
    opening_weight: float = 0.0
    opening_tokens: int = 64
    compile_draft: bool = False  # CUDA: the draft layers under torch.compile (train/compiled_draft.py); experimental

    def __post_init__(self) -> None:
        positive = ("num_anchors", "epochs", "grad_accum", "batch_anchors", "max_seq_len", "save_every",
                    "eval_max_tokens", "log_every", "opening_tokens")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} must be an integer >= 1")
        for name in ("batch_tokens", "max_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name}={v!r} must be an integer >= 1")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every!r} must be an integer >= 0")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r} must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio!r} must be in [0, 1)")
        if self.weight_decay < 0 or not self.grad_clip > 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0 and grad_clip={self.grad_clip!r} > 0")
        if self.time_limit_min is not None and not self.time_limit_min > 0:
            raise ConfigError(f"time_limit_min={self.time_limit_min!r} must be > 0")
        if self.loss_gamma is not None and not self.loss_gamma > 0:
            raise ConfigError(f"loss_gamma={self.loss_gamma!r} must be > 0")
        if not 0 <= self.distill_weight <= 1:
            raise ConfigError(f"distill_weight={self.distill_weight!r} must be in [0, 1]")
        if not 0 <= self.prefix_weight <= 1:
            raise ConfigError(f"prefix_weight={self.prefix_weight!r} must be in [0, 1]")
        for name in ("walk_weight", "opening_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 0")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"val_fraction={self.val_fraction!r} must be in [0, 1)")
        if self.attention not in ("auto", "flex", "sdpa"):
            raise ConfigError(f"attention={self.attention!r} must be one of auto, flex, sdpa")
        if self.batch_anchors < self.num_anchors:
            raise ConfigError(f"batch_anchors={self.batch_anchors} is smaller than num_anchors={self.num_anchors}: "
                              f"one sequence's blocks would not fit in a micro-batch")
        if self.batch_tokens is not None and self.batch_tokens < self.max_seq_len:
            raise ConfigError(f"batch_tokens={self.batch_tokens} is smaller than max_seq_len={self.max_seq_len}: "
                              f"the longest sequence would not fit in a micro-batch")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
