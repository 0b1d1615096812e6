"""Distillation labels (`train-draft --distill-weight W`): the loss against (1 - W) onehot + W p_target equals
autograd through compute_logits, the target rows it reads are the ones that predict each label, and the trainer
still learns the synthetic task with it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig
from blockspec.train.anchors import slot_weights
from blockspec.train.batches import Capacity, build_micro_batch, generator
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import prepare
from blockspec.train.forward import TrainingForward
from blockspec.train.loss import BlockLoss
from blockspec.train.setup import DraftShape, new_draft
from blockspec.train.trainer import train
from test_train_common import MASK
from test_train_common import cycles  # noqa: F401 - fixture, used by name

CPU = torch.device("cpu")


@pytest.mark.parametrize("transform", [{}, {"output_multiplier": 1.5, "final_logit_softcapping": 3.0}],
                         ids=["plain", "multiplier-softcap"])
def test_distill_loss_matches_autograd_through_compute_logits(transform):
    cfg = DFlashConfig.from_hf({"hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "dflash_config": transform}, "t")
    torch.manual_seed(0)
    draft, head = DFlashDraftModel(cfg, 1), torch.nn.Linear(16, 50, bias=False)
    loss = BlockLoss(cfg, head.weight, compiled=False, distill=0.3)
    loss.chunk = 5  # several chunks and a ragged last one
    hidden = torch.randn(23, 16, requires_grad=True)
    rows = torch.tensor([1, 2, 3, 5, 8, 9, 10, 13, 14, 15, 19, 21])
    labels, weights = torch.randint(0, 50, (23,)), torch.rand(23)
    target_h = torch.randn(len(rows), 16)
    losses, hits = loss(hidden, rows, labels, weights, target_h)
    losses.sum().backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    logits = draft.compute_logits(hidden[rows], head)
    with torch.no_grad():
        p = torch.softmax(draft.compute_logits(target_h, head), dim=-1)
    y = 0.3 * p + 0.7 * F.one_hot(labels[rows], 50)
    ref = -(y * torch.log_softmax(logits, dim=-1)).sum(-1) * weights[rows]
    ref.sum().backward()
    assert torch.allclose(losses, ref, rtol=1e-5) and torch.allclose(ours, hidden.grad, atol=1e-6)
    assert torch.equal(hits, logits.argmax(-1) == labels[rows])
    with pytest.raises(ValueError, match="target_h"):
        loss(hidden, rows, labels, weights)


def test_label_sources_are_the_rows_that_predict_each_label(cycles):
    """On the target's own greedy text, the target's argmax at each scored row's label source IS the label."""
    lm, seqs = cycles
    B = 8
    cap = Capacity(4096, 4096, B, pad=False)
    mb = build_micro_batch(seqs[:6], cap, 16, MASK, slot_weights(B, 7.0), generator(2))
    setup = new_draft(lm, DraftShape(1, B, [0, 1], 96, MASK), seed=0, device=CPU)
    fwd = TrainingForward(lm.model, setup.model, [0, 1], cap, "sdpa", compiled=False, distill=0.5)
    _, hidden = fwd.target_pass(mb)
    src = mb.label_src[mb.loss_rows]
    response = torch.cat([s.loss_mask for s in seqs[:6]])
    # the first response token follows the prompt, which the target did not write: every other label must match
    assert bool(response[src + 1].all())
    written = response[src]
    predicted = lm.model.compute_logits(hidden[src]).argmax(-1)
    assert int(written.sum()) > 100 and torch.equal(predicted[written], mb.labels[mb.loss_rows][written])
    assert float(fwd(mb).loss_sum.detach()) > 0
    padded = build_micro_batch(seqs[:6], Capacity(4096, 4096, B, pad=True), 16, MASK, slot_weights(B, 7.0),
                               generator(2))
    Q = len(mb.label_src)
    assert torch.equal(padded.label_src[:Q], mb.label_src) and not padded.label_src[Q:].any()


def test_trainer_learns_the_synthetic_task_with_distillation(cycles, tmp_path):
    lm, seqs = cycles
    cfg = TrainConfig(num_anchors=32, epochs=8, lr=3e-3, warmup_ratio=0.1, batch_anchors=128, max_seq_len=256,
                      eval_every=0, eval_max_tokens=48, distill_weight=0.5)
    setup = new_draft(lm, DraftShape(1, 8, [0, 1], 96, MASK), seed=0, device=CPU)
    report = train(lm, setup, prepare(seqs, cfg, "mem"), cfg, tmp_path, [[10, 11, 12, 13, 14], [30, 33, 36, 39]],
                   use_tqdm=False)
    assert report["config"]["distill_weight"] == 0.5
    assert report["final"]["acc_mean"] > 0.95 and report["tau"] > 6.0, (report["final"], report["tau"])


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile's CPU code needs a C++ compiler")
def test_compiled_distill_loss_equals_eager():
    """The CUDA path compiles the chunk function and pads the rows to whole chunks (target rows too)."""
    cfg = DFlashConfig.from_hf({"hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1,
                                "num_attention_heads": 2}, "t")
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden, rows = torch.randn(23, 16), torch.tensor([0, 4, 5, 6, 11, 12, 20])
    labels, weights, target_h = torch.randint(0, 50, (23,)), torch.rand(23), torch.randn(7, 16)
    out = []
    for compiled in (False, True):
        loss = BlockLoss(cfg, head.weight, compiled=compiled, distill=0.4)
        loss.chunk = 4
        h = hidden.clone().requires_grad_(True)
        losses, hits = loss(h, rows, labels, weights, target_h)
        losses.sum().backward()
        out.append((losses.detach(), hits, h.grad))
    assert torch.allclose(out[0][0], out[1][0], rtol=1e-5) and torch.equal(out[0][1], out[1][1])
    assert torch.allclose(out[0][2], out[1][2], atol=1e-6)
