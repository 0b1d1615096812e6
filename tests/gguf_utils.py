"""Helpers that write small GGUF files the way llama.cpp's converter would, for tests/test_gguf.py.

The HF -> GGUF name table here is written independently of blockspec.loading.gguf_io so that a
mapping mistake there cannot cancel out against the same mistake here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT, GGUFWriter

_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to q_proj/k_proj rows (and biases):
    per head, view the rows as (2, head_dim/2) -- HF's two rotate-half halves -- and transpose to
    (head_dim/2, 2), i.e. interleave them into the (x0, x1) pairs ggml's RoPE rotates. For k_proj the
    converter passes n_head_kv."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_TOP:
        return _HF_TO_GGUF_TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    assert m is not None, hf_name
    return f"blk.{m.group(1)}.{_HF_TO_GGUF_LAYER[m.group(2)]}"


def write_gguf(path: Path, arch: str, meta: dict[str, Any],
               tensors: Sequence[tuple[str, np.ndarray, QT | None]]) -> Path:
    """Write a GGUF: `meta` values typed by their Python type (int -> uint32, float -> float32);
    tensors as (name, array in numpy [out, in] order or raw quantized bytes, raw type or None)."""
    w = GGUFWriter(str(path), arch)
    for key, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, list(v))
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_metadata(arch: str, cfg: Any) -> dict[str, Any]:
    """The metadata llama.cpp's converter writes for a transformers config (the keys read_gguf needs)."""
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": float(theta),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def write_hf_model(path: Path, model: torch.nn.Module, arch: str) -> Path:
    """An F32 GGUF of an HF model, permuting q/k like llama.cpp does for the llama arch only."""
    cfg = model.config
    tensors = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the converter omits output.weight when the embedding is tied
        a = t.detach().float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            a = llama_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = llama_permute(a, cfg.num_key_value_heads)
        tensors.append((gguf_name(name), a, None))
    return write_gguf(path, arch, hf_metadata(arch, cfg), tensors)


def random_kquant_bytes(rng: np.random.Generator, rows: int, cols: int, qtype: QT) -> np.ndarray:
    """Valid raw K-quant blocks: random quants and scales, with the fp16 super-block scales set to
    finite values (random bytes there could be inf/NaN and make exact comparison meaningless)."""
    type_size = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, type_size), dtype=np.uint8)
    fp16_at = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}[qtype]  # d (and dmin) offsets
    for off in fp16_at:
        scale = rng.uniform(-0.01, 0.01, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., off:off + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)
