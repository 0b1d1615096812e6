"""Resuming drafter training: a resumed run equals an uninterrupted one, --time-limit stops cleanly and resumes, and
a checkpoint older than a trajectory setting resumes under that setting's default."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.errors import BlockspecError
from blockspec.train import trainer
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import prepare
from blockspec.train.setup import DraftShape, new_draft
from blockspec.train.trainer import train
from test_train_common import MASK, random_sequences, run_small
from test_train_common import target  # noqa: F401 - fixture, used by name

CPU = torch.device("cpu")


def test_resume_continues_identically(target, tmp_path):
    _, lm = target
    data = random_sequences(24, torch.Generator().manual_seed(3))
    straight, ck1 = run_small(lm, data, tmp_path / "a", max_steps=7)
    run_small(lm, data, tmp_path / "b", max_steps=3)
    resumed, ck2 = run_small(lm, data, tmp_path / "b", max_steps=7, resume=True)
    assert ck1["progress"]["step"] == ck2["progress"]["step"] == 7 and ck1["progress"]["epoch"] == 2
    for (name, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name
    assert str(ck1["optimizer"]) == str(ck2["optimizer"])


def test_time_limit_stops_with_a_checkpoint_and_resume_continues(target, tmp_path, monkeypatch):
    """--time-limit: the run stops at the first step past the limit with a checkpoint, an export and a report that
    says so; --resume then ends where an uninterrupted run ends."""
    _, lm = target
    data = random_sequences(24, torch.Generator().manual_seed(3))
    straight, _ = run_small(lm, data, tmp_path / "a", max_steps=7)
    minutes = iter(range(100))  # each reading of the clock one minute later
    monkeypatch.setattr(trainer, "clock", lambda: 60.0 * next(minutes))
    _, ck = run_small(lm, data, tmp_path / "b", max_steps=7, time_limit_min=2.5)
    report = json.loads((tmp_path / "b" / "train_report.json").read_text())
    assert ck["progress"]["step"] == report["steps"] == 3 and report["stopped_by_time_limit"]
    assert (tmp_path / "b" / "model.safetensors").exists()
    monkeypatch.undo()
    resumed, _ = run_small(lm, data, tmp_path / "b", max_steps=7, resume=True)
    for (name, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name
    assert not json.loads((tmp_path / "b" / "train_report.json").read_text())["stopped_by_time_limit"]


def test_resume_of_a_checkpoint_older_than_a_setting(target, tmp_path):
    """A checkpoint written before a trajectory setting existed resumes when the setting has its default (it ran
    with the default), and is refused when it is changed."""
    _, lm = target
    data = random_sequences(24, torch.Generator().manual_seed(3))
    run_small(lm, data, tmp_path, max_steps=2)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del ckpt["train_config"]["distill_weight"]
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    _, again = run_small(lm, data, tmp_path, max_steps=3, resume=True)
    assert again["progress"]["step"] == 3
    with pytest.raises(BlockspecError, match=r"distill_weight \(0.0 -> 0.5\)"):
        cfg = TrainConfig(num_anchors=6, epochs=3, lr=1e-3, batch_anchors=24, grad_accum=2, max_seq_len=36,
                          max_steps=4, save_every=1000, eval_every=0, distill_weight=0.5)
        setup = new_draft(lm, DraftShape(num_layers=2, block_size=4, target_layer_ids=[0, 2], intermediate_size=32,
                                         mask_token_id=MASK), seed=1, device=CPU)
        train(lm, setup, prepare(data, cfg, "mem"), cfg, tmp_path, None, resume=True, use_tqdm=False)


def test_resume_of_a_checkpoint_with_separate_q_k_v_is_refused_naming_the_export(target, tmp_path):
    """A checkpoint written before the drafter's q/k/v became one qkv_proj cannot be resumed (its optimizer state
    is per separate projection): one clear error that points at the run's export, which --init continues."""
    _, lm = target
    data = random_sequences(24, torch.Generator().manual_seed(3))
    run_small(lm, data, tmp_path, max_steps=2)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    model = ckpt["model"]
    for key in [k for k in model if k.endswith("self_attn.qkv_proj.weight")]:
        q, k, v = model.pop(key).chunk(3)  # the layout of the earlier checkpoints, by name (sizes do not matter here)
        prefix = key.removesuffix("qkv_proj.weight")
        model[prefix + "q_proj.weight"], model[prefix + "k_proj.weight"], model[prefix + "v_proj.weight"] = q, k, v
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    with pytest.raises(BlockspecError, match=rf"earlier blockspec .* --init {tmp_path}$"):
        run_small(lm, data, tmp_path, max_steps=3, resume=True)
