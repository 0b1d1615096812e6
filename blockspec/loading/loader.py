"""Build a target model from a resolved source: config -> module on the device -> weights -> tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.errors import BlockspecError
from blockspec.loading.prepare import TargetOptions, prepare_target
from blockspec.loading.source import ModelSource, resolve_source
from blockspec.loading.tokenizer import Tokenizer
from blockspec.loading.weights import load_weights
from blockspec.models.config import ModelConfig, parse_dtype
from blockspec.models.registry import build_model


@dataclass(frozen=True)
class LoadConfig:
    """How load_model builds a target: where it runs, in which dtype, and the platform variant of its linears
    (loading/prepare.py, TargetOptions). One record, handed whole by the commands, the LLM facade and the draft-model
    load (speculative/registry.py), so that a new load option is added here and not at every call on the way."""

    device: str | None = None  # cpu | cuda | cuda:N; None: cuda when available, else cpu
    dtype: str | None = None  # float32 | bfloat16 | float16; None: float32 on CPU, bfloat16 on GPU (resolve_dtype)
    cpu_packed: bool = False  # CPU: every linear packed once for oneDNN in its own dtype (the drafter follows)
    batch_invariant: bool = False  # GPU: GEMMs and attention computed per row independently of the batch
    cpu_quant: str = "off"  # auto | q8 | q4 | off: CPU linears on packed int8 / int4 weights; auto resolved at load
    with_tokenizer: bool = True  # False: no tokenizer read (drafters, token-id-only tests and benchmarks)

    def target_options(self) -> TargetOptions:
        """The options prepare_target reads (cpu_quant still unresolved: TargetOptions.resolve does that)."""
        return TargetOptions(self.cpu_packed, self.batch_invariant, self.cpu_quant)


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    stop_token_ids: list[int]  # from generation_config, config and tokenizer
    source: ModelSource
    # what the model was loaded with (LoadConfig), as the engine and the reports read it; cpu_quant resolved
    cpu_packed: bool = False  # the linears are packed for oneDNN (LoadConfig.cpu_packed); the drafter follows
    batch_invariant: bool = False  # GEMMs and attention computed per row independently of the batch (GPU)
    cpu_quant: str = "off"  # q4 | q8: the linears run on packed int4 / int8 weights (LoadConfig.cpu_quant, never auto)

    @property
    def row_invariant(self) -> bool:
        """Whether the CPU attention must compute each decode / verify row as a one-row step would: the quantized
        kernels round activations to bf16, which turns CPU SDPA's ulp-level row differences into flipped tokens."""
        return self.cpu_quant != "off"


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BlockspecError(f"unknown device {device!r}; expected 'cpu' or 'cuda' (optionally 'cuda:N')") from None
    if dev.type not in ("cpu", "cuda"):
        raise BlockspecError(f"unsupported device {device!r}; expected 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BlockspecError(f"device {device!r} requested but CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        # fp32 on CPU: exact and fast enough for small models; bf16 on GPU.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return parse_dtype(dtype)


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


def load_model(src: str | None, config: LoadConfig | None = None) -> LoadedModel:
    """The target at `src` (None: the bundled default) built as `config` says (None: LoadConfig's defaults); the
    platform options are checked before any weight is read."""
    config = config or LoadConfig()
    dev = resolve_device(config.device)
    dt = resolve_dtype(config.dtype, dev)
    options = config.target_options().resolve(dev)
    options.check(dev, dt)
    source = resolve_source(src)
    cfg_name = source.path / "config.json" if source.path.is_dir() else source.path  # name the file in errors
    cfg = ModelConfig.from_hf(source.config, source=str(cfg_name))
    model = instantiate(cfg, dev, dt)
    load_weights(model, source.tensors(), str(source.path))
    model.eval()
    prepare_target(model, options)
    tok = source.load_tokenizer() if config.with_tokenizer else None
    return LoadedModel(model, cfg, tok, _stop_ids(cfg, source.generation_config, tok), source, config.cpu_packed,
                       config.batch_invariant, options.cpu_quant)
