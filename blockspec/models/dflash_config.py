"""DFlashConfig: the z-lab DFlash draft checkpoint's config.json, read as-is (a key in dflash_config wins over the
top level). A bad value fails in one line naming the file and the field (DraftConfigError, field=...), before any
weight is read.

The attention pattern is read as the z-lab package's class sees it through transformers' Qwen3Config: a
"sliding_attention" layer is causal unless `is_causal` says otherwise (an explicit `is_causal` applies to every
layer), and has the window `sliding_window` only where `use_sliding_window` lets Qwen3Config keep it. That gate is
where drafters silently lose their window elsewhere: Qwen3Config turns `sliding_window` into None unless
`use_sliding_window` is true, and the package then cannot even build its cache for such a layer. So an explicit
`use_sliding_window: false` beside a window is refused (the config contradicts itself); an absent one keeps the
window the config gives (as configs written outside transformers mean it), and our exports write it true."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NoReturn

from blockspec.errors import ConfigError, ModelLoadError
from blockspec.models.config import rope_params

SLIDING, FULL = "sliding_attention", "full_attention"
# Qwen3Config's sliding_window when use_sliding_window is true and the key is absent (what the z-lab package runs)
QWEN3_DEFAULT_WINDOW = 4096


class DraftConfigError(ConfigError, ModelLoadError):
    """A drafter's config.json field is unusable (a ModelLoadError, as every other bad checkpoint, with `field`)."""


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """k taps spread over the target's depth, skipping the first and last few layers (DFLASH.md section 1)."""
    if k == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


class _Fields:
    """config.json's values, dflash_config's winning, each checked as it is read."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        dcfg = cfg.get("dflash_config")
        if dcfg is not None and not isinstance(dcfg, dict):
            raise DraftConfigError(f"{source}: field 'dflash_config' must be an object, got {dcfg!r}",
                                   field="dflash_config")
        self.cfg, self.dcfg, self.source = cfg, dcfg or {}, source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.dcfg[key] if key in self.dcfg else self.cfg.get(key)
        return default if value is None else value

    def fail(self, key: str, message: str) -> NoReturn:
        raise DraftConfigError(f"{self.source}: field {key!r} {message}", field=key)

    def integer(self, key: str, default: int | None = None, minimum: int = 1, required: bool = False) -> int | None:
        value = self.get(key)
        if value is None:
            if required:
                self.fail(key, "is required and missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None, positive: bool = False) -> float | None:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            self.fail(key, f"must be a {'positive ' if positive else ''}finite number, got {value!r}")
        return float(value)

    def flag(self, key: str, top_level: bool = False) -> bool | None:
        value = self.cfg.get(key) if top_level else self.get(key)
        if value is not None and not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {value!r}")
        return value

    def ids(self, key: str) -> list[int] | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
            self.fail(key, f"must be a list of integer layer indices, got {value!r}")
        return list(value)


def attention_pattern(f: _Fields, n: int) -> tuple[list[bool], list[int | None]]:
    """(causal, window) of each of the n draft layers, as the z-lab package's attention computes them (module doc)."""
    types = f.cfg.get("layer_types")
    if types is None:
        types = [FULL] * n
    if not isinstance(types, list) or len(types) != n or any(t not in (FULL, SLIDING) for t in types):
        f.fail("layer_types", f"must list {n} entries (num_hidden_layers), each {FULL!r} or {SLIDING!r}, got {types!r}")
    is_causal = f.flag("is_causal")
    window: int | None = None
    if SLIDING in types:
        use = f.flag("use_sliding_window", top_level=True)
        window = f.integer("sliding_window")
        if use is False and window is not None:
            f.fail("use_sliding_window", f"is false beside sliding_window={window}: transformers' Qwen3Config (which "
                                         f"the z-lab package loads drafters with) then drops the window; set it true, "
                                         f"or sliding_window null for causal sliding layers without a window")
        if use is True and "sliding_window" not in f.cfg and "sliding_window" not in f.dcfg:
            window = QWEN3_DEFAULT_WINDOW
    causal = [t == SLIDING if is_causal is None else is_causal for t in types]
    return causal, [window if t == SLIDING else None for t in types]


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
    input_embedding_scale: float  # the block's raw target embeddings times this
    output_multiplier: float
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str) -> "DFlashConfig":
        f = _Fields(cfg, source)
        hidden = f.integer("hidden_size", required=True)
        heads = f.integer("num_attention_heads", required=True)
        n = f.integer("num_hidden_layers", required=True)
        assert hidden is not None and heads is not None and n is not None
        kv_heads = f.integer("num_key_value_heads", heads)
        assert kv_heads is not None
        if heads % kv_heads:
            f.fail("num_key_value_heads", f"= {kv_heads} must divide num_attention_heads={heads}")
        try:
            theta, scaling = rope_params(cfg)
        except (TypeError, ValueError) as e:
            f.fail("rope_parameters" if "rope_parameters" in cfg else "rope_theta", f"is unusable ({e})")
        if not theta > 0:
            f.fail("rope_theta", f"must be a positive number, got {theta!r}")
        causal, windows = attention_pattern(f, n)
        softcap = f.number("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size", required=True),  # type: ignore[arg-type]
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=f.integer("head_dim", hidden // heads),  # type: ignore[arg-type]
            rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),  # type: ignore[arg-type]
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=f.integer("max_position_embeddings", 32768),  # type: ignore[arg-type]
            attention_bias=bool(f.flag("attention_bias")),
            vocab_size=f.integer("vocab_size"),
            block_size=f.integer("block_size", 16),  # type: ignore[arg-type]
            num_target_layers=f.integer("num_target_layers"),
            mask_token_id=f.integer("mask_token_id", minimum=0),
            target_layer_ids=f.ids("target_layer_ids"),
            layer_causal=causal,
            layer_window=windows,
            input_embedding_scale=f.number("input_embedding_scale", 1.0, positive=True),  # type: ignore[arg-type]
            output_multiplier=f.number("output_multiplier", 1.0, positive=True),  # type: ignore[arg-type]
            # the z-lab package caps only with a cap > 0
            final_logit_softcapping=softcap if softcap is not None and softcap > 0 else None,
        )

    def validate_block_size(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: a DFlash block needs at least 2 slots")
