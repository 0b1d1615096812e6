"""Tiny DFlash drafters written by the authors' own class (z-lab `dflash` package) for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blockspec.layers import cpu_packed

# tests of the bf16 packed drafter run where oneDNN has bf16 kernels
needs_bf16 = pytest.mark.skipif(not cpu_packed.bf16_supported(torch.device("cpu")),
                                reason="this CPU has no oneDNN bf16 kernels (AVX512-BF16 or AMX)")


def make_zlab_draft(target_cfg, path: Path, *, layers: int = 2, block_size: int = 8, target_layer_ids=(0, 1),
                    mask_token_id: int = 127, seed: int = 0, scale: float = 1.0, intermediate_size: int = 80,
                    head_dim: int = 16, **extra: Any):
    """Write a random z-lab DFlashDraftModel for a tiny target via its own save_pretrained; return the module."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=512, rope_theta=10000.0, use_sliding_window="sliding_window" in extra,
        **{k: v for k, v in extra.items() if k in ("layer_types", "sliding_window")},
    )
    cfg.num_target_layers = target_cfg.num_hidden_layers
    cfg.block_size = block_size
    cfg.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                         **{k: v for k, v in extra.items() if k not in ("layer_types", "sliding_window", "is_causal")}}
    if "is_causal" in extra:
        cfg.is_causal = extra["is_causal"]
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model


def check_fused_draft_prologue(model, device: str, dtype: torch.dtype, tol: float) -> None:
    """The drafter's fused prologue (its packed q|k|v in one GEMM + the Triton split/norm/rotary; the context K/V
    contiguous, and written into a paged pool with slot -1 skipped) equals its reference path, which runs under
    autograd (three GEMMs + torch norms and rotary), within `tol` (relative)."""
    from blockspec.layers import triton_qkv

    attn = model.layers[0].self_attn
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(7, model.config.hidden_size, device=device, generator=g).to(dtype)
    cos, sin = model.rotary.cos_sin(torch.arange(3, 10, device=device), dtype)
    seen: list[tuple[torch.Tensor, ...]] = []
    calls: list[int] = []  # q heads of each fused prologue call

    def capture(layer, q, k, v, scale, causal, window):
        seen.append(tuple(t.detach() for t in (q, k, v)))
        return q

    def kv(paged=None):
        return attn.qkv_proj.kv(x, attn.k_norm, cos, sin, paged)

    with torch.enable_grad():
        ref_kv, ref_out = [t.detach() for t in kv()], attn(x, cos, sin, capture).detach()
    spy = triton_qkv.split_qkv_norm_rope
    triton_qkv.split_qkv_norm_rope = lambda qkv, heads, *a: calls.append(heads) or spy(qkv, heads, *a)
    try:
        with torch.no_grad():
            got_kv, out = kv(), attn(x, cos, sin, capture)
            kc = torch.zeros(12, *got_kv[0].shape[1:], dtype=dtype, device=device)
            vc = torch.zeros_like(kc)
            slots = torch.tensor([4, -1, 0, 11, 7, 2, -1], device=device)
            assert kv(paged=(kc, vc, slots)) == (None, None)  # written into the pool instead
    finally:
        triton_qkv.split_qkv_norm_rope = spy
    assert calls == [0, attn.qkv_proj.num_heads, 0]  # the fused path really ran: context k/v, block, paged k/v
    ok = slots >= 0
    assert torch.equal(kc[slots[ok]], got_kv[0][ok]) and torch.equal(vc[slots[ok]], got_kv[1][ok])
    assert (kc.abs().sum((1, 2)) > 0).sum() == int(ok.sum())  # nothing written for slot -1
    for a, b in [*zip(ref_kv, got_kv), *zip(seen[0], seen[1]), (ref_out, out)]:
        assert a.shape == b.shape and ((a.float() - b.float()).abs() <= tol * b.float().abs().clamp_min(1.0)).all()


def cli_pair(root: Path) -> list[str]:
    """A random tiny qwen3 target (root/t) and a random block-8 drafter for it (root/d); returns the `generate
    --json` command for the target on a fixed prompt (add --draft root/d for speculative decoding)."""
    from hf_utils import make_hf_model, save_hf_model

    hf = make_hf_model("qwen3", seed=12)
    save_hf_model(hf, root / "t")
    make_zlab_draft(hf.config, root / "d", block_size=8, target_layer_ids=[0, 2])
    return ["generate", "--model", str(root / "t"), "--prompt-ids", "4,5,6", "--max-tokens", "16", "--json"]


def make_zlab_draft2(target_cfg, path: Path, *, layers: int = 2, block_size: int = 8, target_layer_ids=(0, 1),
                     mask_token_id: int = 127, seed: int = 0, scale: float = 1.0, conv_kernel_size: int = 3,
                     conv_group_size: int = 8, selector_rank: int = 8, selector_top_k: int = 4,
                     codebook_scale: float = 1.0, conv_noise: float = 0.3, init: dict[str, torch.Tensor] | None = None,
                     **extra: Any):
    """Write a random z-lab DFlash2DraftModel checkpoint for a tiny target as z-lab publishes them (the selector's
    codebooks as raw tensors, no `.weight`), and return the authors' class loaded back from it with their own
    from_pretrained (so their key mapping is what reads the names). `init`: tensors (checkpoint names) to use instead
    of random ones (e.g. a trained DFlash 1 drafter's); conv_noise: how far the convolutions' base kernels are from
    the identity."""
    import json

    from dflash.model import DFlash2DraftModel
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, intermediate_size=80,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rope_theta=10000.0, use_sliding_window="sliding_window" in extra,
        **{k: v for k, v in extra.items() if k in ("layer_types", "sliding_window")},
    )
    cfg.architectures = ["DFlash2DraftModel"]
    cfg.num_target_layers = target_cfg.num_hidden_layers
    cfg.block_size = block_size
    cfg.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
                         "conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
                         "selector_rank": selector_rank, "selector_top_k": selector_top_k,
                         **{k: v for k, v in extra.items() if k not in ("layer_types", "sliding_window", "is_causal")}}
    if "is_causal" in extra:
        cfg.is_causal = extra["is_causal"]
    torch.manual_seed(seed)
    model = DFlash2DraftModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                # near the identity (offset 0 ~ 1), with the other taps clearly in play
                p.copy_(torch.randn_like(p) * conv_noise)
                p[:, 0] += 1.0
            elif name.endswith("kernel_projection.weight"):
                p.copy_(torch.randn_like(p) * conv_noise / p.shape[1] ** 0.5)
            elif "codebook" in name:
                p.copy_(torch.randn_like(p) * codebook_scale)
            elif p.dim() >= 2:
                p.mul_(scale)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state = {k.removesuffix(".weight") if "_codebook." in k else k: v for k, v in state.items()}
    for k, v in (init or {}).items():
        assert k in state and state[k].shape == v.shape, k
        state[k] = v.float().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    (path / "config.json").write_text(json.dumps(conf, indent=1))
    ref = DFlash2DraftModel.from_pretrained(str(path), dtype=torch.float32).eval()
    for k, v in state.items():  # the authors' loader read every tensor under our z-lab names
        name = k if k in dict(ref.named_parameters()) else f"{k}.weight"
        assert torch.equal(ref.get_parameter(name), v), k
    return ref
