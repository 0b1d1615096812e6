"""A family's own config.json fields, read and checked: a bad value fails in one line naming the file and the field
(`ConfigError(field=...)`), before any weight is allocated. models/gpt_oss.py and models/gemma4_spec.py read theirs
here; ModelConfig keeps the fields every family shares."""

from __future__ import annotations

from typing import Any, NoReturn

from blockspec.errors import ConfigError
from blockspec.models.config import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def fail(cfg: ModelConfig, key: str, message: str) -> NoReturn:
    raise ConfigError(f"{cfg.source}: field {key!r} {message}", field=key)


def integer(cfg: ModelConfig, key: str, default: int | None = None, minimum: int = 0) -> int:
    """An integer field; absent or null -> `default` (None: the field is required)."""
    value = cfg.raw.get(key)
    if value is None:
        if default is None:
            fail(cfg, key, "is required and missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fail(cfg, key, f"must be an integer >= {minimum}, got {value!r}")
    return value


def number(cfg: ModelConfig, key: str, default: float | None = None, positive: bool = False) -> float | None:
    """A real-valued field; absent or null -> `default`."""
    value = cfg.raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        fail(cfg, key, f"must be a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def flag(cfg: ModelConfig, key: str, default: bool = False) -> bool:
    value = cfg.raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        fail(cfg, key, f"must be true or false, got {value!r}")
    return value


def choice(cfg: ModelConfig, key: str, allowed: tuple[Any, ...], default: Any = None) -> Any:
    value = cfg.raw.get(key, default)
    if value not in allowed:
        fail(cfg, key, f"must be one of {', '.join(repr(a) for a in allowed)} for {cfg.architecture}, got {value!r}")
    return value


def layer_types(cfg: ModelConfig, default: list[str]) -> list[str]:
    """`layer_types`: per layer "sliding_attention" or "full_attention" (absent: `default`, the family's pattern)."""
    value = cfg.raw.get("layer_types")
    if value is None:
        return default
    n = cfg.num_hidden_layers
    if not isinstance(value, list) or len(value) != n or any(t not in (SLIDING, FULL) for t in value):
        fail(cfg, "layer_types", f"must list {n} entries (num_hidden_layers), each {SLIDING!r} or {FULL!r}, "
                                 f"got {value!r}")
    return list(value)


def sliding_window(cfg: ModelConfig, types: list[str]) -> int | None:
    """The window of the sliding layers (a query at p sees the keys in (p - window, p]); None where there are none."""
    if SLIDING not in types:
        return None
    return integer(cfg, "sliding_window", minimum=1)
