"""DFlashConfig: the z-lab DFlash draft checkpoint's config.json, read as-is (a key in dflash_config wins)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockspec.errors import ConfigError, ModelLoadError
from blockspec.models.config import rope_params


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """k taps spread over the target's depth, skipping the first and last few layers (DFLASH.md section 1)."""
    if k == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    attention_bias: bool
    vocab_size: int | None
    block_size: int
    num_target_layers: int | None
    mask_token_id: int | None
    target_layer_ids: list[int] | None
    layer_causal: list[bool]  # per draft layer: causal inside the block?
    layer_window: list[int | None]  # per draft layer: sliding window or None
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str) -> "DFlashConfig":
        dcfg = cfg.get("dflash_config")
        if dcfg is not None and not isinstance(dcfg, dict):
            raise ModelLoadError(f"{source}: 'dflash_config' must be an object")
        dcfg = dcfg or {}

        def get(key: str, default: Any = None) -> Any:
            return dcfg[key] if key in dcfg else cfg.get(key, default)

        def need(key: str) -> Any:
            v = get(key)
            if v is None:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            return v

        hidden, heads, n = int(need("hidden_size")), int(need("num_attention_heads")), int(need("num_hidden_layers"))
        theta, scaling = rope_params(cfg)
        types = cfg.get("layer_types") or ["full_attention"] * n
        if len(types) != n:
            raise ModelLoadError(f"{source}: 'layer_types' has {len(types)} entries but num_hidden_layers is {n}")
        is_causal = get("is_causal")
        window = get("sliding_window")
        causal, windows = [], []
        for i, t in enumerate(types):
            if t not in ("full_attention", "sliding_attention"):
                raise ModelLoadError(f"{source}: layer_types[{i}] = {t!r} is not 'full_attention' or 'sliding_attention'")
            sliding = t == "sliding_attention"
            # As the authors' class does: sliding layers are causal unless is_causal says otherwise, an explicit
            # is_causal applies to every layer, and a sliding layer without sliding_window has no window.
            causal.append(sliding if is_causal is None else bool(is_causal))
            windows.append(int(window) if sliding and window else None)
        ids = get("target_layer_ids")
        softcap = get("final_logit_softcapping")
        mask = get("mask_token_id")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            attention_bias=bool(get("attention_bias", False)),
            vocab_size=int(cfg["vocab_size"]) if cfg.get("vocab_size") is not None else None,
            block_size=int(get("block_size", 16)),
            num_target_layers=int(get("num_target_layers")) if get("num_target_layers") is not None else None,
            mask_token_id=int(mask) if mask is not None else None,
            target_layer_ids=[int(i) for i in ids] if ids is not None else None,
            layer_causal=causal,
            layer_window=windows,
            input_embedding_scale=float(get("input_embedding_scale", 1.0) or 1.0),
            output_multiplier=float(get("output_multiplier", 1.0) or 1.0),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def validate_block_size(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: a DFlash block needs at least 2 slots")
