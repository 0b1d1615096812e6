"""The trainer's CUDA path (compiled FlexAttention, compiled chunked loss, bf16 autocast) against its exact SDPA path,
and no recompilation from one micro-batch to the next (run on the GPU machine; skipped where CUDA is absent)."""

from __future__ import annotations

import pytest
import torch

from blockspec.train.anchors import slot_weights
from blockspec.train.batches import Capacity, build_micro_batch, generator
from blockspec.train.export import draft_config_dict, random_draft
from blockspec.train.forward import TrainingForward
from test_train_common import MASK, random_sequences, tiny_target

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _setup(tmp_path, layer_types=("sliding_attention", "full_attention")):
    lm = tiny_target(tmp_path)
    lm.model.to(CUDA, torch.bfloat16)
    cfg = draft_config_dict(lm.config, 2, 8, MASK, [0, 2], intermediate_size=48)
    cfg.update(layer_types=list(layer_types), sliding_window=12)
    return lm, random_draft(cfg, seed=2).to(CUDA)


def _batches(n, pad, seed=0):
    cap = Capacity(384, 48, 8, pad)
    seqs = random_sequences(40, torch.Generator().manual_seed(seed), min_len=20, max_len=60)
    return cap, [build_micro_batch(seqs[6 * i:6 * i + 6], cap, 8, MASK, slot_weights(8, 4.0), generator(i)).to(CUDA)
                 for i in range(n)]


def _loss_and_grads(fwd, mb, model):
    model.zero_grad(set_to_none=True)
    r = fwd(mb)
    r.loss_sum.backward()
    return r.loss_sum.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}, r.hits.float().mean()


def test_flex_training_forward_matches_sdpa_on_cuda(tmp_path):
    lm, draft = _setup(tmp_path)
    cap_p, padded = _batches(1, pad=True)
    cap_u, plain = _batches(1, pad=False)
    flex = TrainingForward(lm.model, draft, [0, 2], cap_p, "flex", compiled=True)
    sdpa = TrainingForward(lm.model, draft, [0, 2], cap_u, "sdpa", compiled=False)
    assert padded[0].num_blocks == plain[0].num_blocks and len(padded[0].input_ids) > len(plain[0].input_ids)
    with torch.no_grad():  # the target's taps: flex over the padded batch vs per-sequence SDPA
        t_mask, _ = flex.flex.load(padded[0])
        taps_f = flex.taps(padded[0], t_mask)[: plain[0].num_tokens].float()
        taps_s = sdpa.taps(plain[0]).float()
    assert (taps_f - taps_s).abs().max() <= 0.02 * taps_s.abs().max()
    lf, gf, af = _loss_and_grads(flex, padded[0], draft)
    ls, gs, as_ = _loss_and_grads(sdpa, plain[0], draft)
    assert abs(lf - ls) <= 0.01 * abs(ls) and abs(af - as_) <= 0.02, (lf, ls, af, as_)
    for name in gs:
        cos = torch.nn.functional.cosine_similarity(gf[name].flatten(), gs[name].flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


def test_cuda_training_does_not_recompile_between_micro_batches(tmp_path):
    lm, draft = _setup(tmp_path, ("full_attention", "full_attention"))
    cap, mbs = _batches(5, pad=True, seed=1)
    fwd = TrainingForward(lm.model, draft, [0, 2], cap, "flex", compiled=True)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    losses = []
    import torch._dynamo.config as dcfg

    for i, mb in enumerate(mbs * 4):
        r = fwd(mb)
        (r.loss_sum / mb.weights.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(r.loss_sum.item() / mb.weights.sum().item())
        if i == 0:
            dcfg.error_on_recompile = True  # every later micro-batch has other contents but the same shapes
    dcfg.error_on_recompile = False
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # the same 5 micro-batches, 3 passes later


def test_cuda_training_loop_evaluates_and_exports(tmp_path):
    from blockspec.config import SpeculativeConfig
    from blockspec.loading.draft_loader import load_draft
    from blockspec.train.config import TrainConfig
    from blockspec.train.dataset import prepare
    from blockspec.train.setup import DraftShape, new_draft
    from blockspec.train.trainer import train

    lm = tiny_target(tmp_path / "t")
    lm.model.to(CUDA, torch.bfloat16)
    cfg = TrainConfig(num_anchors=8, epochs=2, batch_anchors=32, grad_accum=2, max_seq_len=64, eval_every=3,
                      eval_max_tokens=16, log_every=2, walk_weight=1.0, val_fraction=0.1,
                      prefix_weight=0.5, opening_weight=1.0)  # the walk, prefix and opening weights on the GPU too
    setup = new_draft(lm, DraftShape(num_layers=2, block_size=8, target_layer_ids=[0, 2], intermediate_size=48,
                                     mask_token_id=MASK), seed=0, device=CUDA)
    data = prepare(random_sequences(30, torch.Generator().manual_seed(7)), cfg, "mem")
    report = train(lm, setup, data, cfg, tmp_path / "out", [[3, 4, 5], [9, 10]], use_tqdm=False)
    assert report["attention"] == "flex" and report["micro_batch_capacity"]["padded"]
    assert report["steps"] == report["planned_steps"] and report["gpu_minutes"] > 0
    assert [e["step"] for e in report["evals"]][-1] == report["steps"] and report["tau"] >= 1.0
    assert report["val"]["walk_tau"] >= 1.0
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "out")), lm)
    assert draft.model.fc.weight.dtype == torch.bfloat16 and draft.spec.target_layer_ids == [0, 2]


def test_compiled_draft_pass_matches_the_eager_one_on_cuda(tmp_path):
    """--compile-draft: the draft layers under inductor around the compiled FlexAttention give the eager pass's loss
    and gradients, and later micro-batches reuse the graphs."""
    import torch._dynamo.config as dcfg

    lm, draft = _setup(tmp_path)
    cap, mbs = _batches(3, pad=True, seed=2)
    eager = TrainingForward(lm.model, draft, [0, 2], cap, "flex", compiled=True)
    fused = TrainingForward(lm.model, draft, [0, 2], cap, "flex", compiled=True, draft_backend="inductor")
    try:
        for i, mb in enumerate(mbs):
            le, ge, _ = _loss_and_grads(eager, mb, draft)
            lf, gf, _ = _loss_and_grads(fused, mb, draft)
            assert abs(lf - le) <= 0.005 * abs(le), (lf, le)
            for name in ge:
                cos = torch.nn.functional.cosine_similarity(gf[name].flatten(), ge[name].flatten(), dim=0)
                assert cos > 0.999, (name, cos.item())
            if i == 0:
                dcfg.error_on_recompile = True
    finally:
        dcfg.error_on_recompile = False
