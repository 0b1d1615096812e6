"""Our DFlash draft + spec loop against the authors' own implementation (z-lab `dflash` package, transformers-based,
no paged cache, no fusion): the drafted tokens of every step and the outputs must match exactly (fp32, CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from blockspec.config import SpeculativeConfig
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from blockspec.train.export import hf_state_dict
from safetensors.torch import load_file
from oracles import spec_generate
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model

zm = pytest.importorskip("dflash.model")


def reference_trace(zd, hf, prompt: list[int], max_new: int, block_size: int):
    """Run the authors' dflash_generate, recording the argmax draft of every step."""
    drafts: list[list[int]] = []
    orig = zd.compute_logits

    def record(hidden, head):
        logits = orig(hidden, head)
        drafts.append(logits.argmax(-1)[0].tolist())
        return logits

    zd.compute_logits = record
    old_time, zm._cuda_time = zm._cuda_time, time.perf_counter  # the reference times with CUDA events only
    try:
        out = zm.dflash_generate(zd, hf, torch.tensor([prompt]), max_new, None, block_size=block_size,
                                 return_stats=True)
    finally:
        zm._cuda_time = old_time
        zd.compute_logits = orig
    return out.output_ids[0, len(prompt):].tolist(), out.acceptance_lengths, drafts


DRAFT_VARIANTS = {
    "plain": {},
    "sliding_causal": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "sliding_noncausal": {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 5,
                          "is_causal": False},
    "scaled": {"input_embedding_scale": 1.7, "output_multiplier": 0.8, "final_logit_softcapping": 3.0},
}


CASES = [("llama", "plain", 3), ("qwen3", "plain", 7), ("llama", "sliding_causal", 7), ("qwen3", "sliding_causal", 3),
         ("llama", "sliding_noncausal", 3), ("qwen3", "sliding_noncausal", 7), ("qwen3", "scaled", 3),
         ("llama", "scaled", 7)]


@pytest.mark.parametrize("arch,variant,K", CASES)
def test_traces_match_reference(tmp_path, arch, variant, K):
    hf = make_hf_model(arch, seed=2)
    hf.generation_config.eos_token_id = None
    save_hf_model(hf, tmp_path / "t")
    zd = make_zlab_draft(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 2], scale=3.0,
                         **DRAFT_VARIANTS[variant])
    lm = load_model(str(tmp_path / "t"), LoadConfig(device="cpu", with_tokenizer=False))
    dr = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d"), num_draft_tokens=K), lm)
    prompt = [5, 17, 99, 3, 42, 8, 1, 9, 60, 61][: 4 + K]
    ref_ids, ref_lens, ref_drafts = reference_trace(zd, hf, prompt, 40, block_size=K + 1)
    ours = spec_generate(lm, dr, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert ours.token_ids == ref_ids
    # Near max_tokens the reference shrinks its last blocks (fewer MASK slots change a non-causal draft);
    # we always draft K. Compare every step the reference drafted at full width: all but the last few.
    full = [i for i, d in enumerate(ref_drafts) if len(d) == K]
    assert len(full) >= 10 and full == list(range(len(full)))
    assert [s.draft for s in ours.steps[: len(full)]] == ref_drafts[: len(full)]
    assert ours.acceptance_lengths[: len(full)] == ref_lens[: len(full)]


def test_load_packs_qkv_and_export_restores_the_checkpoint_names(tmp_path):
    """load_draft packs each layer's q_proj/k_proj/v_proj into one qkv_proj whose row blocks ARE the checkpoint's
    tensors (the fused GPU prologue's single matrix: nothing is packed later), and the export writes back exactly the
    checkpoint's names and values."""
    hf = make_hf_model("qwen3", seed=5)
    save_hf_model(hf, tmp_path / "t")
    make_zlab_draft(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 2])
    lm = load_model(str(tmp_path / "t"), LoadConfig(device="cpu", dtype="float32", with_tokenizer=False))
    model = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm).model
    ckpt = load_file(str(tmp_path / "d" / "model.safetensors"))
    for i, layer in enumerate(model.layers):
        w = layer.self_attn.qkv_proj.weight
        parts = [ckpt[f"layers.{i}.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
        assert w.is_contiguous() and torch.equal(w, torch.cat(parts))
    exported = hf_state_dict(model)
    assert exported.keys() == ckpt.keys() and all(torch.equal(exported[k], ckpt[k]) for k in ckpt)
