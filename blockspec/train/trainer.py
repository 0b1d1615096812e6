"""The drafter training loop: AdamW + warmup/cosine, gradient accumulation and clipping, checkpoint/resume, a progress
bar with loss and per-slot accuracy, periodic tau evaluation with the engine, export in the z-lab format, a report."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from blockspec.loading.loader import LoadedModel
from blockspec.models.dflash import DFlashDraftModel
from blockspec.train.anchors import default_gamma, slot_weights
from blockspec.train.checkpoint import Progress, load_checkpoint, save_checkpoint
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import TrainingSet, capacity, plan_epochs
from blockspec.train.distributed import DataParallel, check_global_batch
from blockspec.train.evaluate import evaluate_tau
from blockspec.train.export import save_draft
from blockspec.train.forward import TrainingForward
from blockspec.train.fsdp import sharded_bytes
from blockspec.train.metrics import Window
from blockspec.train.steps import StepBatches
from blockspec.train.validate import split_validation, validate

REPORT = "train_report.json"
LOG = "train_log.jsonl"


@dataclass
class DraftSetup:
    """The drafter being trained: fp32 master weights on the training device, and its z-lab config.json."""

    model: DFlashDraftModel
    config: dict[str, Any]
    tap_layers: list[int]  # the target layers whose residual streams the drafter reads
    mask_token_id: int


clock = time.monotonic  # the wall clock of --time-limit (a module attribute, so tests can drive it)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=params[0].is_cuda)
    warmup = round(cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:  # linear warmup, then cosine from 1 to 0 over the remaining steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _check_grads(model: torch.nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:  # fail loudly instead of training half a model
        raise RuntimeError(f"no gradient reached {', '.join(missing)}: a forward-only (Triton) kernel ran under "
                           f"autograd; the model code must take its fused CUDA kernels only when "
                           f"torch.is_grad_enabled() is False")


def _sum_gradients(dp: DataParallel, params: list[torch.Tensor], step_loss: torch.Tensor) -> None:
    """Every rank's gradients (and step losses) summed, once per optimizer step; a rank without a micro-batch in this
    step adds zeros."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    dp.sum_([p.grad for p in params] + [step_loss])


def _join_run(dp: DataParallel, setup: DraftSetup, data: TrainingSet, cfg: TrainConfig) -> None:
    """Ranks that disagree on the settings or the data would plan different steps and wait for each other forever:
    refuse that on every rank; then every rank starts from rank 0's drafter, as DDP does."""
    check_global_batch(cfg.grad_accum, dp.world_size)
    dp.agree("settings", {**cfg.to_dict(), "draft": setup.config}, "launch every rank with the same flags")
    dp.agree("training data", data.fingerprint(), "--data must name the same data on every rank (on a filesystem "
                                                  "every host sees, or identical copies)")
    with torch.no_grad():
        dp.broadcast_([p.data for p in setup.model.parameters()])


def train(lm: LoadedModel, setup: DraftSetup, data: TrainingSet, cfg: TrainConfig, out_dir: str | Path,
          eval_prompts: list[list[int]] | None = None, resume: bool = False, use_tqdm: bool = True,
          dp: DataParallel | None = None) -> dict[str, Any]:
    """Train setup.model in place on `data`; write checkpoints, the exported drafter and a report into out_dir.
    dp: this process is one rank of a data-parallel run (train/distributed.py): it trains on its share of every
    step, and only rank 0 writes into out_dir and evaluates tau with the engine."""
    deadline = clock() + 60 * cfg.time_limit_min if cfg.time_limit_min else None
    out = Path(out_dir)
    main = dp is None or dp.main
    if main:
        out.mkdir(parents=True, exist_ok=True)
    if dp is not None:
        _join_run(dp, setup, data, cfg)
    model = setup.model
    device = next(model.parameters()).device
    B = model.config.block_size
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    cap = capacity(data, cfg, B, pad=attention == "flex")  # before the split: held-out sequences must fit too
    data, val = split_validation(data, cfg.val_fraction, cfg.seed)
    plans = plan_epochs(data, cap, cfg)
    data_key = {"sequences": len(data.seqs), "tokens": data.num_tokens}
    total_steps = sum(math.ceil(len(p) / cfg.grad_accum) for p in plans)
    optimizer, scheduler = make_optimizer(model, cfg, total_steps)
    progress = Progress()
    if resume:
        def load() -> dict[str, Any]:
            return load_checkpoint(out, cfg, setup.config, data_key, device)

        ckpt = load() if dp is None else dp.together(load)  # every rank reads the same checkpoint
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        progress = ckpt["progress"]
    cuda = device.type == "cuda"
    fwd = TrainingForward(lm.model, model, setup.tap_layers, cap, attention, compiled=cuda, walk_weight=cfg.walk_weight,
                          draft_backend="inductor" if cfg.compile_draft and cuda else None, distill=cfg.distill_weight,
                          prefix_weight=cfg.prefix_weight, opening_weight=cfg.opening_weight,
                          opening_tokens=cfg.opening_tokens, selector_weight=cfg.selector_weight)
    w_slot = slot_weights(B, cfg.loss_gamma or default_gamma(B))
    params = [p for p in model.parameters() if p.requires_grad]
    window = Window(B, device, selector=fwd.selector is not None)
    stop_at = min(total_steps, cfg.max_steps or total_steps)
    log = (out / LOG).open("a") if main else None
    bar = tqdm(total=stop_at, initial=min(progress.step, stop_at), desc="train-draft", unit="step",
               disable=not use_tqdm or not main, dynamic_ncols=True)

    def evaluate() -> None:
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"step": progress.step}
        said = []
        if eval_prompts and main:  # the engine runs the whole target, on rank 0 alone
            entry.update(evaluate_tau(lm, model, eval_prompts, cfg.eval_max_tokens))
            said.append(f"tau {entry['tau']:.3f} on {len(eval_prompts)} held-out prompts")
        if val is not None:
            entry["val"] = v = validate(fwd, val, cap, cfg, setup.mask_token_id, w_slot, dp)
            said.append(f"held-out sequences: loss {v['loss']:.3f}, acc {v['acc_mean']:.3f}, block tau {v['tau']:.2f}, "
                        f"walk tau {v['walk_tau']:.2f}")
        if said:
            progress.eval_time_s += time.perf_counter() - t0
            progress.evals.append(entry)
            if main:
                bar.write(f"step {progress.step}: {'; '.join(said)}")

    step_batches = StepBatches(data, plans, cap, cfg, setup.mask_token_id, w_slot, device, dp)
    shown: dict[str, Any] = {}
    t_start = time.perf_counter()
    pending = step_batches(progress.epoch, progress.micro) if progress.step < stop_at else None
    while pending is not None:
        step = pending
        step_loss = torch.zeros((), device=device)
        for mb in step.mbs:
            r = fwd(mb)
            (r.loss_sum / step.weight).backward()
            step_loss += r.plain_loss_sum
            window.add(r, mb)
        for mb in step.fillers:
            fwd.target_only(mb)
        progress.tokens += step.tokens
        progress.blocks += step.blocks
        if progress.step == 0 and step.mbs:
            _check_grads(model)
        if dp is not None:
            _sum_gradients(dp, params, step_loss)
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.weight += step.local_weight
        progress.step += 1
        progress.micro += step.count
        if progress.micro >= len(plans[progress.epoch]):
            progress.epoch, progress.micro = progress.epoch + 1, 0
        timed_out = deadline is not None and clock() >= deadline and progress.step < stop_at
        if dp is not None and deadline is not None:
            timed_out = dp.any(timed_out)  # the ranks' clocks differ: all stop if one is out of time
        # the next step's batches are built on the host while the GPU still runs this one
        pending = step_batches(progress.epoch, progress.micro) if progress.step < stop_at and not timed_out else None
        shown.update(loss=f"{step_loss.item() / step.weight:.3f}", lr=f"{scheduler.get_last_lr()[0]:.1e}",
                     epoch=progress.epoch)  # the one host sync per step
        done = progress.step >= stop_at or timed_out
        if progress.step % cfg.log_every == 0 or done:
            now = time.perf_counter()
            progress.train_time_s += now - t_start
            t_start = now
            if dp is not None:
                window.all_reduce(dp)
            s = window.summary()
            progress.last_log = {"step": progress.step, "lr": scheduler.get_last_lr()[0], **s}
            if log is not None:
                log.write(json.dumps(progress.last_log) + "\n")
                log.flush()
            # accuracy of the draft argmax per block slot over the window: mean, slot 1, slot B-1; and the
            # acceptance length those hits would give on the training blocks
            shown.update(acc=f"{s['acc_mean']:.3f}", acc1=f"{s['acc'][0]:.3f}", accK=f"{s['acc'][-1]:.3f}",
                         tau=f"{s['tau']:.2f}", tok_s=f"{s['tokens_per_s']:.0f}")
            if "selector_loss" in s:  # DFlash 2
                shown.update(sel=f"{s['selector_loss']:.3f}", recall=f"{s['candidate_recall']:.3f}")
            window.reset()
        bar.set_postfix(shown, refresh=False)
        bar.update(1)
        if cfg.eval_every and progress.step % cfg.eval_every == 0 and not done:
            evaluate()
            t_start = time.perf_counter()
        if main and (progress.step % cfg.save_every == 0 or done):
            # the exported drafter follows every checkpoint, so a run killed by a time limit leaves a usable one
            save_draft(model, setup.config, out)
            save_checkpoint(out, model, optimizer, scheduler, progress, cfg, setup.config, data_key)
    bar.close()
    if log is not None:
        log.close()
    timed_out = progress.step < stop_at
    if timed_out and main:  # no final evaluation: the time is up (the run's end evaluates)
        print(f"train-draft: time limit ({cfg.time_limit_min:g} min) reached at step {progress.step} of {stop_at}; "
              f"the checkpoint and the exported drafter are saved, --resume continues", file=sys.stderr)
    elif not timed_out and (not progress.evals or progress.evals[-1]["step"] != progress.step):
        evaluate()
    report = _report(progress, cfg, data, val, cap, total_steps, attention, device, timed_out)
    # what each rank holds of the frozen target (less than the whole under --fsdp): rank 0's, in bytes
    report["ranks"] = {"world_size": dp.world_size if dp is not None else 1, "fsdp": dp is not None and dp.fsdp,
                       "target_weight_bytes": sharded_bytes(lm.model)}
    if main:
        save_draft(model, setup.config, out)
        save_checkpoint(out, model, optimizer, scheduler, progress, cfg, setup.config, data_key)
        (out / REPORT).write_text(json.dumps(report, indent=1) + "\n")
    return report


def _report(progress: Progress, cfg: TrainConfig, data: TrainingSet, val: TrainingSet | None, cap, total_steps: int,
            attention: str, device: torch.device, timed_out: bool) -> dict[str, Any]:
    t = progress.train_time_s
    return {
        "steps": progress.step, "planned_steps": total_steps, "stopped_by_time_limit": timed_out,
        "epoch": progress.epoch, "micro_batch": progress.micro,
        "target_tokens": progress.tokens, "anchor_blocks": progress.blocks,
        "train_time_s": round(t, 2), "eval_time_s": round(progress.eval_time_s, 2),
        "tokens_per_s": round(progress.tokens / t, 1) if t > 0 else None,
        "blocks_per_s": round(progress.blocks / t, 1) if t > 0 else None,
        "gpu_minutes": round((t + progress.eval_time_s) / 60, 2) if device.type == "cuda" else None,
        "final": progress.last_log, "evals": progress.evals,
        "tau": progress.evals[-1].get("tau") if progress.evals else None,
        "val": progress.evals[-1].get("val") if progress.evals else None,
        "data": {"sequences": len(data.seqs), "tokens": data.num_tokens, "anchors_per_epoch": sum(data.anchors),
                 "dropped_without_anchor": data.num_dropped, "cut_to_max_seq_len": data.num_cut,
                 "held_out_sequences": len(val.seqs) if val is not None else 0},
        "micro_batch_capacity": {"tokens": cap.tokens, "anchors": cap.anchors, "padded": cap.pad},
        "attention": attention, "device": str(device), "torch": torch.__version__, "config": cfg.to_dict(),
    }
