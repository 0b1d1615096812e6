"""ModelConfig: the HF config.json fields every model family reads, in transformers-4 and -5 styles. A field only one
family knows (Llama's attention_bias, say) is read by that family's file (models/llama.py: `layer_traits`) through
`ModelConfig.flag` (booleans) or `ModelConfig.integer` (sizes, e.g. Qwen3-MoE's expert counts), so adding a family adds
no field here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from blockspec.errors import ModelLoadError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    name = str(name).replace("torch.", "")
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either `rope_theta`+`rope_scaling` (transformers 4)
    or `rope_parameters` (transformers 5, which also holds rope_theta)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = dict(params)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if isinstance(cfg.get("rope_scaling"), dict) else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
    return theta, scaling


# fields of a vision-language config.json's top level that win over its text_config's
_TOP_LEVEL_WINS = ("architectures", "tie_word_embeddings", "dtype", "torch_dtype")


def text_model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as the language model's fields: a vision-language checkpoint (Qwen3.5's ...ForConditionalGeneration)
    nests them under `text_config`, read here as if at the top level (the top level's architectures, tying and dtype
    winning); any other config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or "hidden_size" in cfg:
        return cfg
    merged = dict(text)
    for key, value in cfg.items():
        if key not in ("text_config", "vision_config") and (key not in text or key in _TOP_LEVEL_WINS):
            merged[key] = value
    return merged


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
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
    tie_word_embeddings: bool
    dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the whole config.json, for the family's own fields
    source: str = field(default="config.json", repr=False, compare=False)  # the file, named in errors

    def flag(self, key: str, default: bool = False) -> bool:
        """A true / false config.json field that one family reads (`layer_traits`); absent or null -> `default`. A
        value of another type fails naming the field rather than being taken for its truth value."""
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise ModelLoadError(f"{self.source}: field {key!r} must be true or false, got {value!r}")

    def integer(self, key: str, default: int | None = None, minimum: int = 0) -> int:
        """An integer config.json field that one family reads (a mixture-of-experts size, say); absent or null ->
        `default`, or, where there is none, a failure naming the field. A value of another type or below `minimum`
        fails naming the field and the value."""
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ModelLoadError(f"{self.source}: required field {key!r} is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelLoadError(f"{self.source}: field {key!r} must be an integer >= {minimum}, got {value!r}")
        return value

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        cfg = text_model_fields(cfg)
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelLoadError(f"{source}: field 'architectures' is missing or empty")
        arch = archs[0]

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        theta, scaling = rope_params(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            # a model whose every MLP is routed experts (Qwen3.5-MoE) has no dense size: 0
            intermediate_size=int(need("intermediate_size")) if "moe_intermediate_size" not in cfg
            else int(cfg.get("intermediate_size") or 0),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype"), torch.float32),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
            source=source,
        )
