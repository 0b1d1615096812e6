"""A target and a DFlash drafter with random weights of a given real shape, for the GPU benchmarks: speed does not
depend on the weights' values (acceptance does, which the benchmarks force)."""

from __future__ import annotations

import torch

from blockspec.loading.dflash_options import ResolvedSpec
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel, instantiate
from blockspec.models.config import ModelConfig
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig


def make_pair(shape: dict, K: int, draft_layers: int, taps: list[int], mask: int, device: torch.device,
              dtype: torch.dtype) -> tuple[LoadedModel, LoadedDraft]:
    """A target of `shape` and a block-16 drafter over it, both with random weights (std 0.02)."""
    cfg = ModelConfig.from_hf({**shape, "dtype": str(dtype).removeprefix("torch.")})
    target = instantiate(cfg, device, dtype)
    dcfg = DFlashConfig.from_hf({**shape, "architectures": ["DFlashDraftModel"], "num_hidden_layers": draft_layers,
                                 "block_size": 16, "dflash_config": {"mask_token_id": mask, "target_layer_ids": taps}},
                                "bench")
    with torch.device(device):
        draft = DFlashDraftModel(dcfg, num_taps=len(taps)).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for m in (target, draft):
        for p in m.parameters():
            p.data.normal_(0, 0.02, generator=gen)
    lm = LoadedModel(target.eval(), cfg, None, [], None)  # type: ignore[arg-type]
    return lm, LoadedDraft(draft.eval(), dcfg, ResolvedSpec(K, mask, taps, 16, False))
