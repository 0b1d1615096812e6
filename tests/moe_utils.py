"""Tiny random Qwen3-MoE checkpoints for tests/test_qwen3_moe.py, made with transformers (the reference), GGUF files of
them written the way llama.cpp's converter writes qwen3moe (stacked expert banks), and the prefill/decode runner that
compares our model with transformers'.

The HF -> GGUF expert names here are written independently of blockspec.loading.gguf_io, so that a mapping mistake
there cannot cancel out against the same mistake here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from blockspec.layers.moe import SparseMoeBlock
from blockspec.models.config import ModelConfig
from blockspec.models.decoder import MLP
from dense_cache import DenseCausalAttention, DenseKVCache
from gguf_utils import gguf_name, hf_metadata, write_gguf

VOCAB = 128


def tiny_moe_config(**overrides: Any):
    import transformers as tf

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
               num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2)
    cfg.update(overrides)
    return tf.Qwen3MoeConfig(**cfg)


def make_hf_moe(seed: int = 0, **overrides: Any):
    """A random tiny Qwen3MoeForCausalLM in fp32. HF's init leaves the router near zero (every expert tied, so a
    ulp would pick the experts) and the experts' output small next to the residual; both are scaled up so routing has
    clear margins and the experts move the logits. Norms are perturbed so the tests see them."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif ".mlp.experts." in name:
                p.copy_(torch.randn_like(p) * 0.15)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_moe(model, path: Path) -> Path:
    """HF's own save_pretrained: the per-expert names (experts.{e}.gate_proj.weight ...), as the hub holds them."""
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def stacked_banks(model) -> dict[str, np.ndarray]:
    """HF name -> array, with each MoE layer's experts as llama.cpp stacks them: {layer}.gate_exps / up_exps
    [E, I, H] and down_exps [E, H, I]. Read from transformers 5's in-memory stacked parameters."""
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if m is None:
            out[name] = a
        elif m.group(2) == "down_proj":
            out[f"{m.group(1)}.down_exps"] = a
        else:
            half = a.shape[1] // 2
            out[f"{m.group(1)}.gate_exps"] = np.ascontiguousarray(a[:, :half])
            out[f"{m.group(1)}.up_exps"] = np.ascontiguousarray(a[:, half:])
    return out


def quantize_experts(model, qtype: QT) -> dict[str, np.ndarray]:
    """Round the model's expert banks through `qtype` in place (so transformers then runs the weights the GGUF holds)
    and return the raw quantized banks by stacked name (for write_moe_gguf)."""
    raw: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
            if m is None:
                continue
            a = p.detach().float().numpy()
            q = quantize(a, qtype)
            p.copy_(torch.from_numpy(dequantize(q, qtype).reshape(a.shape).copy()))
            if m.group(2) == "down_proj":
                raw[f"{m.group(1)}.down_exps"] = q
            else:
                half = q.shape[1] // 2
                raw[f"{m.group(1)}.gate_exps"] = np.ascontiguousarray(q[:, :half])
                raw[f"{m.group(1)}.up_exps"] = np.ascontiguousarray(q[:, half:])
    return raw


_EXPS = {"gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps", "down_exps": "ffn_down_exps"}


def write_moe_gguf(path: Path, model, raw: dict[str, np.ndarray] | None = None, qtype: QT | None = None,
                   **meta_overrides: Any) -> Path:
    """A qwen3moe GGUF of `model` (F32; the expert banks from `raw` in `qtype` when given), with the metadata and
    names llama.cpp's converter gives it: ffn_gate_inp [E, H], ffn_{gate,up}_exps [E, I, H], ffn_down_exps [E, H, I]."""
    cfg = model.config
    tensors = []
    for name, a in stacked_banks(model).items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(gate_exps|up_exps|down_exps)", name)
        if m is not None:
            quant = raw is not None and name in raw
            tensors.append((f"blk.{m.group(1)}.{_EXPS[m.group(2)]}.weight", raw[name] if quant else a,
                            qtype if quant else None))
        elif name.endswith(".mlp.gate.weight"):
            tensors.append((name.replace("model.layers.", "blk.").replace(".mlp.gate.", ".ffn_gate_inp."), a, None))
        else:
            tensors.append((gguf_name(name), a, None))
    meta = hf_metadata("qwen3moe", cfg)
    meta.update({"qwen3moe.expert_count": cfg.num_experts, "qwen3moe.expert_used_count": cfg.num_experts_per_tok,
                 "qwen3moe.expert_feed_forward_length": cfg.moe_intermediate_size})
    meta.update(meta_overrides)
    return write_gguf(path, "qwen3moe", {k: v for k, v in meta.items() if v is not None}, tensors)


# ---- running our model and comparing it with transformers' ------------------------------------------------


def prefill_decode(lm, ids: torch.Tensor, split: int, taps: list[int]):
    """Our logits and taps over `ids`: a prefill of ids[:split], then one-token decode steps over the dense cache."""
    cfg = lm.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    logits, tapped = [], []
    with torch.no_grad():
        for lo, hi in [(0, split)] + [(p, p + 1) for p in range(split, len(ids))]:
            pos = torch.arange(lo, hi)
            out = lm.model(ids[lo:hi], pos, DenseCausalAttention(cache, pos, hi), tap_layers=taps)
            logits.append(out.logits)
            tapped.append(out.taps)
    return torch.cat(logits), torch.cat(tapped) if taps else None


def assert_matches_transformers(lm, hf, tol: float = 2e-5) -> None:
    """Several prompts, each prefilled in part and decoded the rest of the way, against HF's full forward (causal: the
    same logits); taps at every layer against HF's hidden states (the last one final-normed, as drafters expect)."""
    n, H = lm.config.num_hidden_layers, lm.config.hidden_size
    g = torch.Generator().manual_seed(5)
    for length, split in [(37, 30), (9, 1), (64, 60)]:
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        with torch.no_grad():
            ref = hf(ids[None], output_hidden_states=True)
        logits, taps = prefill_decode(lm, ids, split, list(range(n)))
        assert (logits - ref.logits[0]).abs().max().item() <= tol, length
        for i in range(n):
            assert (taps[:, i * H:(i + 1) * H] - ref.hidden_states[i + 1][0]).abs().max().item() <= tol, (length, i)


def moe_block(seed: int, experts: int = 8, top_k: int = 3, hidden: int = 64) -> SparseMoeBlock:
    """A lone random MoE block (renormalized top-k) with weights large enough that routing has clear margins."""
    cfg = ModelConfig("x", VOCAB, hidden, 32, 1, 4, 2, 16, 1e-6, 1e4, None, 64, False, torch.float32)  # experts' I=32
    torch.manual_seed(seed)
    block = SparseMoeBlock(hidden, torch.nn.ModuleList(MLP(cfg) for _ in range(experts)), top_k, True)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block.eval()
