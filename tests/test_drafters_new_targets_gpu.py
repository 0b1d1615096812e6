"""Drafters of the newer target families on CUDA (run on the GPU machine; skipped where CUDA is absent), fp32 so that
the comparisons are tight:
- the trainer's CUDA path (compiled FlexAttention over a padded micro-batch; windowed and sink layers of the target
  on the exact SDPA path, a hybrid's recurrent layers over a fresh slot per sequence and one for the padding) ==
  its per-sequence SDPA path, taps and loss;
- greedy DFlash through the engine on CUDA (Triton draft attention with the drafter's sliding window, captured
  steps) drafts what the z-lab package drafts (on the CPU, from transformers' hidden states), every step, but for
  near-ties of the reference's logits."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from dflash_utils import make_zlab_draft
from drafter_targets import FAMILIES, FULL, MASK, SLIDE, Step, check_flex_equals_sdpa, zlab_steps

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FAMILY_NAMES = list(FAMILIES)


def target_on_cuda(family: str, root):
    hf = FAMILIES[family](0)
    hf.save_pretrained(str(root))
    return hf, load_model(str(root), LoadConfig(device="cuda", dtype="float32", with_tokenizer=False))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_cuda_training_pass_equals_sdpa(tmp_path, family):
    check_flex_equals_sdpa(target_on_cuda(family, tmp_path / "t")[1], CUDA, compiled=True)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_cuda_engine_drafts_what_the_zlab_package_drafts(tmp_path, family):
    pytest.importorskip("dflash.model")
    hf, lm = target_on_cuda(family, tmp_path / "t")
    zd = make_zlab_draft(hf.config, tmp_path / "d", block_size=6, mask_token_id=MASK, scale=3.0,
                         target_layer_ids=[1, 3], layer_types=[SLIDE, FULL], sliding_window=4,
                         input_embedding_scale=8.0)
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)
    prompt = [5, 17, 99, 3, 42, 8, 1, 9, 60]
    out = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=2)).generate(
        [prompt], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    seq = torch.tensor(prompt + out.token_ids)
    full = [s for s in out.steps if len(s.draft) == 5]
    assert len(full) >= 15
    ref = zlab_steps(zd, hf, seq, [Step(s.position, int(seq[s.position])) for s in full], 6)
    # CUDA's fp32 kernels round differently from the CPU reference: a draft whose reference top two logits are
    # within 1e-4 of the largest magnitude may go either way (random weights make near-ties); every other one must
    # agree, and near-ties must stay rare
    decided = total = 0
    for step, logits in zip(full, ref):
        top = logits.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 1e-4 * max(1.0, logits.abs().max().item())
        total += clear.numel()
        margin = (top[:, 0] - top[:, 1]).tolist()
        for ours, want, sure, m in zip(step.draft, logits.argmax(-1).tolist(), clear.tolist(), margin):
            if sure:
                decided += 1
                assert ours == want, (step.position, step.draft, logits.argmax(-1).tolist(), m,
                                      logits.abs().max().item())
    assert decided >= 0.9 * total, (decided, total)
