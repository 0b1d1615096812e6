"""Tiny targets of the newer DFlash target families (Qwen3.5 hybrids dense and MoE, gpt-oss, Gemma 4), made by
transformers, and the two drafter passes the drafter tests compare on them, step by step the way dflash_generate
drives a drafter: the z-lab package's (its own DynamicCache, cropped after each step, its own masks, the target's
hidden states from transformers) and blockspec's (context K/V appended into a paged pool through a scattered block
table, the paged reference draft attention, the taps of OUR target's training pass)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

import hybrid_utils
import test_gemma4
import test_gpt_oss
from blockspec.attention.paged_ref import PagedBatch, PagedDraftAttention, store
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.train.attention import PackedCausalAttention
from blockspec.train.target_pass import shared_kv_layers, state_kwargs

VOCAB = 128  # every family's tiny config
MASK = VOCAB - 1
SLIDE, FULL = "sliding_attention", "full_attention"

# family -> a random tiny model (fp32, eval): 4 layers each; Qwen3.5's are linear, linear, linear, full; gpt-oss and
# Gemma 4 with target windows of 3 and 5 and (Gemma 4) the last two layers sharing K/V, per-layer inputs, a logit cap
FAMILIES: dict[str, Callable[[int], Any]] = {
    "qwen3_5": lambda seed: hybrid_utils.make_hf(seed),
    "qwen3_5_moe": lambda seed: hybrid_utils.make_hf(seed, moe=True),
    "gpt_oss": lambda seed: test_gpt_oss.make_hf(seed, **test_gpt_oss.CONFIGS["own-pattern"][1]),
    "gemma4": lambda seed: test_gemma4.make_hf(seed, **test_gemma4.CONFIGS["shared-kv-per-layer-inputs"][1]),
}


def make_target(family: str, root: Path, seed: int = 0) -> tuple[Any, LoadedModel]:
    """(transformers' model, blockspec's load of the directory it saved)."""
    hf = FAMILIES[family](seed)
    hf.save_pretrained(str(root))
    return hf, load_model(str(root), LoadConfig(device="cpu", with_tokenizer=False))


@dataclass(frozen=True)
class Step:
    ctx_end: int  # the context is positions < ctx_end; the block starts there
    bonus: int  # the block's slot 0


def steps_over(seq: torch.Tensor, ends: list[int]) -> list[Step]:
    return [Step(e, int(seq[e])) for e in ends]


def our_taps(lm: LoadedModel, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[T, k * H]: the taps of one sequence through the drafter trainer's target pass (train/target_pass.py)."""
    mb = SimpleNamespace(input_ids=ids, positions=torch.arange(len(ids)), seq_lens=[len(ids)])
    attn = PackedCausalAttention(mb, shared=shared_kv_layers(lm.model))  # type: ignore[arg-type]
    with torch.no_grad():
        return lm.model(ids, mb.positions, attn, tap_layers=layer_ids, **state_kwargs(lm.model, mb)).taps


def zlab_steps(zd, hf, seq: torch.Tensor, steps: list[Step], block_size: int) -> list[torch.Tensor]:
    """The z-lab drafter's logits [B - 1, vocab] at each step, as dflash_generate computes them."""
    import dflash.model as zm

    with torch.no_grad():
        feats = zm.extract_context_feature(hf(seq[None], output_hidden_states=True).hidden_states,
                                           zd.target_layer_ids)
        cache = zm._make_cache(zd.config)
        scale = float(zm._draft_value(zd.config, "input_embedding_scale", 1.0))
        out, done = [], 0
        for s in steps:
            block = torch.tensor([[s.bonus] + [zd.mask_token_id] * (block_size - 1)])
            noise = zm._raw_input_embeddings(hf, block, scale)
            hidden = zd(target_hidden=feats[:, done:s.ctx_end], noise_embedding=noise,
                        position_ids=torch.arange(done, s.ctx_end + block_size)[None], past_key_values=cache,
                        use_cache=True)[:, 1 - block_size:]
            zm._crop_to(cache, s.ctx_end)
            out.append(zd.compute_logits(hidden, zm._output_head(hf))[0].float())
            done = s.ctx_end
    return out


def our_steps(draft: LoadedDraft, lm: LoadedModel, seq: torch.Tensor, steps: list[Step], block_size: int,
              page: int = 4) -> list[torch.Tensor]:
    """Our drafter's logits [B - 1, vocab] at each step: context K/V of the new committed rows appended into the
    paged draft pool (blocks scattered), the block over it through the paged reference draft attention."""
    model, cfg = draft.model, draft.model.config
    taps = our_taps(lm, seq, draft.spec.target_layer_ids)
    pages = -(-(max(s.ctx_end for s in steps) + block_size) // page)
    table = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(1))[:pages]
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    pool = KVPool(pages + 3, page, CacheShape(1, 1, 1), shape, torch.float32, torch.device("cpu"))
    out, done = [], 0
    with torch.no_grad():
        for s in steps:
            pos = torch.arange(done, s.ctx_end)
            slots = table[pos // page] * page + pos % page
            for layer, (k, v) in enumerate(model.context_kv(taps[done:s.ctx_end], pos)):
                store(pool.draft_k[layer], pool.draft_v[layer], k, v, slots)
            block_pos = torch.arange(s.ctx_end, s.ctx_end + block_size)
            batch = PagedBatch(block_pos, torch.full_like(block_pos, -1),
                               torch.tensor([0, block_size], dtype=torch.int32),
                               torch.tensor([s.ctx_end], dtype=torch.int32), table[None], block_size)
            ids = torch.tensor([s.bonus] + [draft.spec.mask_token_id] * (block_size - 1))
            hidden = model(lm.model.embed_tokens(ids), block_pos, PagedDraftAttention(pool, batch), block_size)
            out.append(model.compute_logits(hidden[1:], lm.model.lm_head))
            done = s.ctx_end
    return out


def check_flex_equals_sdpa(lm: LoadedModel, device: torch.device, compiled: bool) -> None:
    """The trainer's padded FlexAttention pass (the target's windowed / sink layers on the exact SDPA path, a
    hybrid's recurrent layers over a fresh slot per sequence and one for the padding, K/V kept for layers sharing
    it) == its per-sequence SDPA pass over the same sequences: taps (fp32) and loss (bf16 autocast on CUDA)."""
    from blockspec.data.shards import TokenSequence
    from blockspec.train.anchors import slot_weights
    from blockspec.train.batches import Capacity, build_micro_batch, generator
    from blockspec.train.forward import TrainingForward
    from blockspec.train.setup import DraftShape, new_draft

    ids = [0, 1, lm.config.num_hidden_layers - 1]
    shape = DraftShape(num_layers=2, block_size=4, target_layer_ids=ids, intermediate_size=32, mask_token_id=MASK,
                       sliding_window=5)
    draft = new_draft(lm, shape, 0, device).model
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(5):
        n = int(torch.randint(20, 60, (1,), generator=g))
        seqs.append(TokenSequence(torch.randint(0, MASK, (n,), generator=g), torch.arange(n) >= 4))
    cap_p, cap_u = Capacity(384, 48, 4, True), Capacity(384, 48, 4, False)
    padded, plain = [build_micro_batch(seqs, cap, 8, MASK, slot_weights(4, 4.0), generator(0)).to(device)
                     for cap in (cap_p, cap_u)]
    flex = TrainingForward(lm.model, draft, ids, cap_p, "flex", compiled=compiled)
    sdpa = TrainingForward(lm.model, draft, ids, cap_u, "sdpa", compiled=False)
    with torch.no_grad():
        assert flex.flex is not None
        t_mask, _ = flex.flex.load(padded)
        taps_p = flex.taps(padded, t_mask)
        taps_s = sdpa.taps(plain)
        assert torch.isfinite(taps_p).all()  # the padding rows too: they feed masked keys
        assert (taps_p[: plain.num_tokens] - taps_s).abs().max() <= 1e-3 * taps_s.abs().max()
        lf, ls = flex(padded).loss_sum.item(), sdpa(plain).loss_sum.item()
    assert abs(lf - ls) <= 0.01 * abs(ls), (lf, ls)


def assert_same_drafts(ours: list[torch.Tensor], ref: list[torch.Tensor], tol: float = 1e-4) -> None:
    """Each step's logits within `tol` of the reference's largest magnitude."""
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err <= tol, (i, err)
