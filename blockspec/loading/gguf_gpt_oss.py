"""llama.cpp's gpt-oss GGUF layout (what its converter writes for GptOssForCausalLM) as HF names and config.json
fields, for loading/gguf_io.py.

Tensors: `attn_sinks` [heads]; `post_attention_norm` (HF's post_attention_layernorm); the router `ffn_gate_inp` with
its bias; the experts as stacked banks [E, out, in] in MXFP4 (or any type the reader takes) with bias banks [E, out]:
`ffn_gate_exps` / `ffn_up_exps` (the converter de-interleaves HF's gate_up bank into the two) and `ffn_down_exps`,
each handed on per expert (`EXPERT_SLOT`). Keys: the expert counts and size, `attention.sliding_window`; the layer
pattern is llama.cpp's fixed one for gpt-oss, even layers sliding, which is HF's default, so no `layer_types` is
written; so are the SwiGLU's alpha and clamp (1.702, 7: HF's defaults, the released models'). YaRN is written without
`truncate`: HF's gpt-oss computes it untruncated, so that is said here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockspec.errors import ModelLoadError
from blockspec.loading.gguf_moe import EXPERT_SLOT

ARCH = "gpt-oss"
# GGUF block tensor kind -> HF name within the layer (over gguf_io's shared table)
BLK = {"post_attention_norm": "post_attention_layernorm",
       "attn_sinks": "self_attn.sinks",
       "ffn_gate_inp": "mlp.router",
       "ffn_gate_exps": f"mlp.experts.{EXPERT_SLOT}.gate_proj",
       "ffn_up_exps": f"mlp.experts.{EXPERT_SLOT}.up_proj",
       "ffn_down_exps": f"mlp.experts.{EXPERT_SLOT}.down_proj"}


def config(meta: dict[str, Any], base: dict[str, Any], path: Path) -> dict[str, Any]:
    """The config.json fields gpt-oss adds to (or changes in) gguf_io's `base`."""
    key = f"{ARCH}.attention.sliding_window"
    if key not in meta:
        raise ModelLoadError(f"{path}: required GGUF metadata key {key!r} is missing")
    out: dict[str, Any] = {"sliding_window": int(meta[key])}
    rope = base.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("rope_type") == "yarn":
        out["rope_scaling"] = {**rope, "truncate": False}
    width = meta.get(f"{ARCH}.expert_feed_forward_length")
    if width is not None:  # each expert's width: HF's intermediate_size (feed_forward_length is written alike)
        out["intermediate_size"] = int(width)
    return out
