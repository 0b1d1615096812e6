"""TrainConfig: the drafter-training hyper-parameters (defaults from the DFlash paper, DFLASH.md section 5)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from blockspec.errors import ConfigError

# Fields that fix the sequence of batches and updates: a checkpoint resumes only under the same values.
TRAJECTORY_FIELDS = ("num_anchors", "epochs", "lr", "weight_decay", "warmup_ratio", "grad_clip", "grad_accum",
                     "batch_anchors", "batch_tokens", "max_seq_len", "seed", "loss_gamma", "attention", "val_fraction",
                     "walk_weight", "distill_weight", "prefix_weight", "opening_weight", "opening_tokens",
                     "selector_weight")


@dataclass
class TrainConfig:
    num_anchors: int = field(default=512, metadata={"help": "anchor blocks per sequence (at most)"})
    epochs: int = field(default=6, metadata={"help": "passes over the training data"})
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate"})
    # Mild decoupled decay on weight matrices only: the drafter sees a few million tokens for several epochs, and
    # norm gains (multiplicative scales starting at 1) must not be pulled towards 0.
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay of the weight matrices"})
    warmup_ratio: float = field(default=0.04, metadata={"help": "share of the steps the learning rate warms up"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clip"})
    # the global batch: under torchrun each of the W ranks runs grad_accum / W of a step's micro-batches, so a run
    # resumes on another number of ranks with the same steps (train/steps.py)
    grad_accum: int = field(default=1, metadata={
        "help": "micro-batches per optimizer step, over all ranks together (the global batch; under torchrun a "
                "multiple of the world size)"})
    # B rows each: the unit of draft compute
    batch_anchors: int = field(default=4096, metadata={"help": "anchor blocks per micro-batch"})
    batch_tokens: int | None = field(default=None, metadata={
        "help": "target tokens per micro-batch (default: from the data's tokens per anchor)"})
    max_seq_len: int = field(default=3072, metadata={
        "help": "longer sequences are cut to their first MAX_SEQ_LEN tokens"})
    seed: int = field(default=0, metadata={
        "help": "seed of the initialization, the batch order and the generated data"})
    # None: the paper's value for the block size (anchors.default_gamma)
    loss_gamma: float | None = field(default=None, metadata={
        "help": "slot weight decay (default 7/5/4 for B 16/10/8)"})
    max_steps: int | None = field(default=None, metadata={
        "help": "stop after N optimizer steps (resumable; the LR schedule still spans all epochs)"})
    # stop (checkpoint + export, as at the end) at the first step after this many minutes of train(): for jobs with
    # a wall-clock limit; --resume continues the same schedule
    time_limit_min: float | None = field(default=None, metadata={
        "flag": "--time-limit", "metavar": "MIN",
        "help": "stop after MIN minutes of training (checkpoint and export as at the end; --resume continues): for "
                "jobs with a wall-clock limit"})
    save_every: int = field(default=500, metadata={"help": "optimizer steps between checkpoints (and one at the end)"})
    eval_every: int = field(default=1000, metadata={
        "help": "optimizer steps between evaluations (0: at the end)"})
    eval_max_tokens: int = field(default=256, metadata={"help": "new tokens per evaluation prompt"})
    log_every: int = field(default=10, metadata={"help": "optimizer steps per line of train_log.jsonl"})
    attention: str = field(default="auto", metadata={
        "choices": ["auto", "flex", "sdpa"], "help": "flex (CUDA default) or exact per-sequence SDPA (CPU default)"})
    # scored by train/validate.py
    val_fraction: float = field(default=0.0, metadata={
        "help": "training sequences held out and scored at every evaluation: loss, per-slot accuracy and block "
                "acceptance length next to the training windows' (shows overfitting); e.g. 0.02"})
    # the walk: train/walk.py
    walk_weight: float = field(default=0.0, metadata={
        "help": "extra loss weight of the blocks the verification walk visits (where the engine's blocks start, "
                "right after a wrong draft); 0: off (the bundled drafter's last stages used 2, then 4)"})
    # labels mixed with the target's own next-token distribution: (1 - w) onehot + w p_target (train/loss.py); 0: off
    distill_weight: float = field(default=0.0, metadata={
        "metavar": "W", "help": "mix the target's own next-token distribution into the labels: (1 - W) onehot + "
                                 "W p_target (0: hard labels, the paper's loss; experimental)"})
    # a slot's loss x (1 - p) unless the drafter hit every earlier slot of its block, where verification would reach
    # it (train/forward.py); 0: off
    prefix_weight: float = field(default=0.0, metadata={
        "metavar": "P", "help": "scale a slot's loss by 1 - P where the drafter missed an earlier slot of its "
                                 "block (verification never reaches it there); 0: off, 1: only reachable slots "
                                 "train (experimental)"})
    # extra loss weight of the blocks anchored in a response's first opening_tokens tokens (train/forward.py); 0: off
    opening_weight: float = field(default=0.0, metadata={
        "metavar": "W", "help": "extra loss weight of the blocks anchored in a response's first --opening-tokens "
                                 "tokens, where acceptance is lowest; 0: off (experimental)"})
    opening_tokens: int = field(default=64, metadata={
        "metavar": "N", "help": "what --opening-weight counts as a response's opening (default 64)"})
    # DFlash 2 only: the candidate selector's own loss (train/selector_loss.py) is added with this weight
    selector_weight: float = field(default=1.0, metadata={
        "metavar": "W", "help": "DFlash 2: weight of the candidate selector's loss (cross-entropy over its top-k "
                                 "candidates given the true previous token) beside the block loss (default 1)"})
    # how: train/compiled_draft.py
    compile_draft: bool = field(default=False, metadata={
        "help": "CUDA: run the draft layers under torch.compile, fusing their element-wise work over the block rows "
                "(experimental: docs/training.md)"})

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
        for name in ("walk_weight", "opening_weight", "selector_weight"):
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


# z-lab's published DFlash 2 drafters (e.g. for Qwen3.8-27B) use these values
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


@dataclass
class DraftArch:
    """Which drafter a new run trains (`--arch`) and, for DFlash 2, its own config fields (docs/dflash2.md). With
    --init the drafter's config.json decides, except that `--arch dflash2` upgrades a DFlash 1 drafter."""

    arch: str | None = field(default=None, metadata={
        "choices": ["dflash", "dflash2"], "metavar": "{dflash,dflash2}",
        "help": "drafter architecture: dflash (DFlash 1, the default) or dflash2 (convolutions along the block and "
                "a candidate selector, docs/dflash2.md); with --init, dflash2 upgrades a DFlash 1 drafter (it then "
                "drafts as before: identity convolutions, a selector that picks the argmax)"})
    conv_kernel_size: int = field(default=DFLASH2_DEFAULTS["conv_kernel_size"], metadata={
        "metavar": "K", "help": "DFlash 2: taps of each causal convolution along the block (default 2)"})
    conv_group_size: int = field(default=DFLASH2_DEFAULTS["conv_group_size"], metadata={
        "metavar": "G", "help": "DFlash 2: channels sharing one dynamic kernel weight; divides the hidden size "
                                "(default 16)"})
    selector_rank: int = field(default=DFLASH2_DEFAULTS["selector_rank"], metadata={
        "metavar": "R", "help": "DFlash 2: rank of the selector's predecessor / successor codebooks (default 256)"})
    selector_top_k: int = field(default=DFLASH2_DEFAULTS["selector_top_k"], metadata={
        "metavar": "K", "help": "DFlash 2: candidates per draft position the selector picks from (default 16)"})

    def __post_init__(self) -> None:
        if self.arch not in (None, "dflash", "dflash2"):
            raise ConfigError(f"arch={self.arch!r} must be dflash or dflash2", field="arch")
        for name in DFLASH2_DEFAULTS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}={v!r} must be an integer >= 1", field=name)

    @property
    def dflash2(self) -> bool:
        return self.arch == "dflash2"

    def dflash2_fields(self) -> dict[str, int]:
        """The DFlash 2 config fields, as config.json's dflash_config holds them."""
        return {name: getattr(self, name) for name in DFLASH2_DEFAULTS}
