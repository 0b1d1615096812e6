"""Gemma 4's text-model fields, read once from config.json (or a multimodal checkpoint's text_config) and checked: a
bad value fails in one line naming the field (models/fields.py), before any weight is allocated. What each layer is
(`LayerShape`) is resolved here as transformers resolves it, so models/gemma4.py only builds what this says.

- layer kinds: `layer_types` (default: five sliding layers, then a full one; the last layer is always full);
- per-layer head shapes: full layers take `per_layer_config`'s overrides where config.json has them, else
  `global_head_dim` (default 512) and, with `attention_k_eq_v`, `num_global_key_value_heads`;
- KV sharing: the last `num_kv_shared_layers` layers compute no K/V of their own; each attends over the K/V of the
  last earlier layer of its kind (transformers' "store" layer); the pool holds the other layers' caches only;
- rotary per kind (`rope_parameters` = {kind: {rope_type, rope_theta, ...}}; default: sliding 10^4, full
  "proportional" over a quarter of the head at 10^6);
- the pool's one K/V row shape (`cache_heads` x `cache_dim`): the largest head count and head size of any caching
  layer; a layer with fewer heads repeats each (GQA groups unchanged), a smaller head is zero-padded (no score
  changes: q is padded alike and the scale is explicit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockspec.models import fields
from blockspec.models.config import ModelConfig
from blockspec.models.fields import FULL, SLIDING

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")
_ROPE_DEFAULTS: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class LayerShape:
    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    window: int | None  # sliding layers: a query at p sees the keys in (p - window, p]
    k_eq_v: bool  # full layers with attention_k_eq_v: the values are the (value-normed) key projection
    kv_layer: int  # the layer whose K/V it attends over: itself, or the earlier layer it shares them with
    intermediate: int  # the dense MLP's width (doubled in KV-sharing layers with use_double_wide_mlp)


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int  # top_k_experts
    intermediate: int  # moe_intermediate_size


@dataclass(frozen=True)
class Gemma4Spec:
    layers: tuple[LayerShape, ...]
    rope: dict[str, tuple[float, dict[str, Any] | None]]  # kind -> (theta, scaling) for layers/rotary.py
    activation: str  # hidden_activation
    final_logit_softcapping: float | None
    per_layer_dim: int  # hidden_size_per_layer_input (0: no per-layer inputs)
    per_layer_vocab: int  # vocab_size_per_layer_input
    moe: MoeShape | None  # enable_moe_block: routed experts beside the dense MLP in every layer
    attention_bias: bool
    cache_layers: int  # layers with a cache of their own: the first ones (the others share theirs)
    cache_heads: int
    cache_dim: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Gemma4Spec":
        n, raw = cfg.num_hidden_layers, cfg.raw
        default = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
        types = fields.layer_types(cfg, default)
        types[-1] = FULL  # as transformers forces it (with a warning there)
        window = fields.sliding_window(cfg, types)
        bidirectional = fields.choice(cfg, "use_bidirectional_attention", (None, "vision"))
        del bidirectional  # "vision": images see each other both ways; text, all this serves, stays causal
        shapes = _head_shapes(cfg, types)
        shared = fields.integer(cfg, "num_kv_shared_layers", default=0)
        if shared >= n:
            fields.fail(cfg, "num_kv_shared_layers", f"must leave a layer computing K/V (num_hidden_layers={n}), "
                                                     f"got {shared}")
        first = n - shared
        if not set(types[first:]) <= set(types[:first]):
            fields.fail(cfg, "num_kv_shared_layers", f"={shared} leaves a layer kind with no earlier layer to share "
                                                     f"K/V with (layer_types {types!r})")
        source = [i if i < first else max(j for j in range(first) if types[j] == types[i]) for i in range(n)]
        double = fields.flag(cfg, "use_double_wide_mlp")
        k_eq_v = fields.flag(cfg, "attention_k_eq_v")
        layers = tuple(LayerShape(t, *shapes[i], window if t == SLIDING else None, k_eq_v and t == FULL, source[i],
                                  cfg.intermediate_size * (2 if double and i >= first else 1))
                       for i, t in enumerate(types))
        heads = max(layers[i].num_kv_heads for i in range(first))
        for i in range(first):
            if heads % layers[i].num_kv_heads or cfg.num_attention_heads % heads:
                fields.fail(cfg, "num_key_value_heads", f"(per layer, with per_layer_config) must give every caching "
                                                        f"layer a K/V head count dividing the largest ({heads}), "
                                                        f"which must divide num_attention_heads="
                                                        f"{cfg.num_attention_heads}; layer {i} has "
                                                        f"{layers[i].num_kv_heads}")
        per_layer = fields.integer(cfg, "hidden_size_per_layer_input", default=0)
        return cls(
            layers=layers, rope={t: _rope(cfg, t) for t in set(types)},
            activation=fields.choice(cfg, "hidden_activation", ACTIVATIONS, "gelu_pytorch_tanh"),
            final_logit_softcapping=fields.number(cfg, "final_logit_softcapping", positive=True),
            per_layer_dim=per_layer,
            per_layer_vocab=fields.integer(cfg, "vocab_size_per_layer_input", cfg.vocab_size, 1) if per_layer else 0,
            moe=_moe(cfg), attention_bias=fields.flag(cfg, "attention_bias"),
            cache_layers=first, cache_heads=heads, cache_dim=max(layers[i].head_dim for i in range(first)))

    def cache_index(self, layer: int) -> int:
        """Where layer `layer`'s K/V live in the pool: its own cache, or the one of the layer it shares them with."""
        return self.layers[layer].kv_layer


def _head_shapes(cfg: ModelConfig, types: list[str]) -> list[tuple[int, int]]:
    """(head_dim, num_kv_heads) per layer, as transformers' per_layer_config resolves them."""
    base = (cfg.head_dim, cfg.num_key_value_heads)
    overrides = cfg.raw.get("per_layer_config")
    if overrides is None:  # a config.json written before per_layer_config: the global-layer fields
        dim = fields.integer(cfg, "global_head_dim", default=512, minimum=1)
        heads = fields.integer(cfg, "num_global_key_value_heads", default=0) or None
        full = (dim, heads if heads and fields.flag(cfg, "attention_k_eq_v") else cfg.num_key_value_heads)
        return [full if t == FULL else base for t in types]
    if not isinstance(overrides, dict):
        fields.fail(cfg, "per_layer_config", f"must map layer indices to field overrides, got {overrides!r}")
    shapes = []
    for i in range(len(types)):
        o = overrides.get(str(i), overrides.get(i, {}))  # type: ignore[call-overload]
        if not isinstance(o, dict) or set(o) - {"head_dim", "num_key_value_heads"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in o.values()):
            fields.fail(cfg, "per_layer_config", f"layer {i}: only positive head_dim / num_key_value_heads overrides "
                                                 f"are supported, got {o!r}")
        shapes.append((o.get("head_dim", base[0]), o.get("num_key_value_heads", base[1])))
    return shapes


def _rope(cfg: ModelConfig, kind: str) -> tuple[float, dict[str, Any] | None]:
    params = cfg.raw.get("rope_parameters") or _ROPE_DEFAULTS
    p = params.get(kind) if isinstance(params, dict) else None
    if not isinstance(p, dict) or not isinstance(p.get("rope_theta", 0), (int, float)):
        fields.fail(cfg, "rope_parameters", f"must give each layer kind's rotary ({kind!r}: {{rope_type, "
                                            f"rope_theta, ...}}), got {params!r}")
    scaling = dict(p)
    scaling.setdefault("rope_type", "default")
    theta = float(scaling.pop("rope_theta", _ROPE_DEFAULTS[kind]["rope_theta"]))
    return theta, None if scaling["rope_type"] == "default" else scaling


def _moe(cfg: ModelConfig) -> MoeShape | None:
    if not fields.flag(cfg, "enable_moe_block"):
        return None
    experts = fields.integer(cfg, "num_experts", minimum=1)
    top_k = fields.integer(cfg, "top_k_experts", minimum=1)
    if top_k > experts:
        fields.fail(cfg, "top_k_experts", f"must be at most num_experts={experts}, got {top_k}")
    return MoeShape(experts, top_k, fields.integer(cfg, "moe_intermediate_size", minimum=1))
