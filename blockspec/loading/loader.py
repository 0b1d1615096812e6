"""Build a target model from a resolved source: config -> module on the device -> weights -> the platform's variant
(loading/platform.py decides it, loading/prepare.py makes it) -> tokenizer. LoadConfig (load_config.py), resolve_device
and resolve_dtype (platform.py) are imported from here by older callers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from blockspec.loading import platform
from blockspec.loading.load_config import LoadConfig
from blockspec.loading.platform import PlatformPlan, resolve_device, resolve_dtype
from blockspec.loading.prepare import prepare_target
from blockspec.loading.source import ModelSource, resolve_source
from blockspec.loading.tokenizer import Tokenizer
from blockspec.loading.weights import load_weights
from blockspec.models.config import ModelConfig, parse_dtype
from blockspec.models.registry import build_model

__all__ = ["LoadConfig", "LoadedModel", "instantiate", "load_model", "resolve_device", "resolve_dtype"]


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    stop_token_ids: list[int]  # from generation_config, config and tokenizer
    source: ModelSource
    # what runs it (loading/platform.py), completed for this model; the default: plain, as built in memory
    plan: PlatformPlan = field(default_factory=PlatformPlan)

    @property
    def cpu_packed(self) -> bool:
        """The linears are packed for oneDNN (LoadConfig.cpu_packed); the drafter follows."""
        return self.plan.cpu_packed

    @property
    def batch_invariant(self) -> bool:
        """GEMMs and attention computed per row independently of the batch (GPU)."""
        return self.plan.batch_invariant

    @property
    def cpu_quant(self) -> str:
        """q4 | q8: the linears run on packed int4 / int8 weights (LoadConfig.cpu_quant resolved: never auto)."""
        return self.plan.cpu_quant

    @property
    def row_invariant(self) -> bool:
        """Whether the CPU attention must compute each decode / verify row as a one-row step would (PlatformPlan)."""
        return self.plan.row_invariant


def _stop_ids(cfg: ModelConfig, gen: dict, tok: Tokenizer | None) -> list[int]:
    ids: list[int] = []
    g = gen.get("eos_token_id")
    for group in (g if isinstance(g, list) else [g] if g is not None else [], cfg.eos_token_ids):
        ids.extend(int(i) for i in group)
    if tok is not None and tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    return sorted(set(ids))


def instantiate(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Allocate uninitialized weights directly on the device (random init of an 8B model would take minutes)."""
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def load_model(src: str | None, config: LoadConfig | None = None, plan: PlatformPlan | None = None) -> LoadedModel:
    """The target at `src` (None: the bundled default) built as `config` says (None: LoadConfig's defaults), in the
    variant the platform plan chooses (`plan`: one made already for `config`, e.g. with the drafter's); what this
    platform cannot run is refused before any weight is read."""
    config = config or LoadConfig()
    plan = plan or platform.plan(config)
    dev = torch.device(plan.device)
    source = resolve_source(src)
    cfg_name = source.path / "config.json" if source.path.is_dir() else source.path  # name the file in errors
    cfg = ModelConfig.from_hf(source.config, source=str(cfg_name))
    model = instantiate(cfg, dev, parse_dtype(plan.dtype))
    load_weights(model, source.tensors(), str(source.path))
    model.eval()
    plan = prepare_target(model, plan)
    tok = source.load_tokenizer() if config.with_tokenizer else None
    return LoadedModel(model, cfg, tok, _stop_ids(cfg, source.generation_config, tok), source, plan)
