"""The DFlash 2 draft model (z-lab `DFlash2DraftModel` checkpoints, loaded as they are).

DFlash 2 is DFlash 1 (models/dflash.py: same context projection, same paged context K/V, same attention) with two
additions:
  - in every layer, a grouped dynamic causal convolution around the attention and another around the MLP: the
    normed input is convolved before the sublayer and the sublayer's output after it, with per-channel base kernels
    plus per-position, per-group kernels predicted from the normed input (`kernel_projection`);
  - the candidate selector (models/dflash2_selector.py) instead of a per-position argmax.

The convolution is causal along the draft block only: position j of a block mixes block rows j, j-1, .., j-k+1 and
sees zeros before the block's first row (the bonus). The context never enters it (the context reaches the block
through attention alone, as in DFlash 1), so it needs no state from earlier steps: nothing about it is cached, and
preemption, prefix-cache hits and batching cannot change what it computes. It only needs to know where each block
starts, which is why forward takes the rows of a block."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockspec.errors import ModelLoadError
from blockspec.models.dflash import DFlashDraftModel, DFlashLayer, DraftAttentionFn
from blockspec.models.dflash2_selector import CandidateSelector
from blockspec.models.dflash_config import DFlashConfig

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 0  # taps of each causal convolution (block rows j-k+1..j)
    conv_group_size: int = 0  # channels per group sharing one dynamic kernel weight
    selector_rank: int = 0  # rank of the selector's predecessor/successor score
    selector_top_k: int = 0  # candidates per draft position

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str) -> "DFlash2Config":
        base = super().from_hf(cfg, source)
        dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
        values: dict[str, int] = {}
        for name in DFLASH2_FIELDS:
            v = dcfg[name] if name in dcfg else cfg.get(name)
            if v is None:
                raise ModelLoadError(f"{source}: required DFlash 2 field {name!r} is missing")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelLoadError(f"{source}: {name}={v!r} must be an integer >= 1")
            values[name] = v
        group, hidden = values["conv_group_size"], base.hidden_size
        if hidden % group:
            raise ModelLoadError(f"{source}: conv_group_size={group} must divide hidden_size={hidden}")
        if base.vocab_size is None:
            raise ModelLoadError(f"{source}: required field 'vocab_size' is missing (the DFlash 2 selector's "
                                 f"codebooks have one row per token)")
        top_k = values["selector_top_k"]
        if top_k > base.vocab_size:
            raise ModelLoadError(f"{source}: selector_top_k={top_k} exceeds vocab_size={base.vocab_size}")
        assert isinstance(base, DFlash2Config)
        return dataclasses.replace(base, **values)


class GroupedDynamicCausalConv(nn.Module):
    """out[j] = sum_o (base[o] + dyn[j, o, group]) * x[j - o] over block rows, x[< 0] = 0. Two kernel sets: side 0
    for the sublayer's input (prepare), side 1 for its output (finish); both sides' dynamic kernels are predicted
    from the sublayer's normed input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (T = blocks * rows) -> (x convolved with side 0, side 1's dynamic kernels for finish)."""
        dyn = self.kernel_projection(x).view(-1, rows, 2, self.kernel_size, self.groups)
        return self._convolve(x, dyn[:, :, 0], 0, rows), dyn[:, :, 1]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor, rows: int) -> torch.Tensor:
        return self._convolve(y, dyn, 1, rows)

    def _convolve(self, x: torch.Tensor, dyn: torch.Tensor, side: int, rows: int) -> torch.Tensor:
        """x [T, H], dyn [T / rows, rows, kernel_size, groups] -> [T, H]."""
        ks, G = self.kernel_size, self.groups
        blocks = x.view(-1, rows, G, self.group_size)
        # ks - 1 zero rows in front of every block: the shift by o reads them where j - o < 0
        padded = torch.cat([blocks.new_zeros(blocks.shape[0], ks - 1, G, self.group_size), blocks], dim=1)
        base = self.base_kernel[side].to(x.dtype).view(ks, G, self.group_size)
        out = None
        for o in range(ks):
            shifted = padded[:, ks - 1 - o: ks - 1 - o + rows]  # x[j - o]
            term = base[o] * shifted
            out = term if out is None else out + term
            out = torch.addcmul(out, dyn[:, :, o, :, None], shifted)  # + the position's own kernel weight
        assert out is not None
        return out.reshape(x.shape)


class DFlash2Layer(DFlashLayer):
    def __init__(self, cfg: DFlash2Config, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: DraftAttentionFn, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """As DFlashLayer.forward, each sublayer between its two convolutions; rows: rows of one block (0: h is one
        block)."""
        rows = rows or h.shape[0]
        if delta is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add_forward(delta, h)
        x, dyn = self.attention_conv.prepare(x, rows)
        a = self.attention_conv.finish(self.self_attn(x, cos, sin, attn), dyn, rows)
        x, h = self.post_attention_layernorm.add_forward(a, h)
        x, dyn = self.mlp_conv.prepare(x, rows)
        return h, self.mlp_conv.finish(self.mlp(x), dyn, rows)


class DFlash2DraftModel(DFlashDraftModel):
    config: DFlash2Config

    layer_class = DFlash2Layer

    def __init__(self, cfg: DFlash2Config, num_taps: int) -> None:
        super().__init__(cfg, num_taps)
        assert cfg.vocab_size is not None  # DFlash2Config.from_hf checked it
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    def block_drafts(self, hidden: torch.Tensor, anchor: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The selector's greedy pass: hidden [B, K, H] at the draft positions, anchor [B] (the bonus) -> [B, K]. The
        candidates come from the argmax head's logits (token ids < draft_vocab_size when set)."""
        B, K, H = hidden.shape
        logits = self._scale_logits(self.greedy_head(hidden.reshape(B * K, H), lm_head).float())
        return self.candidate_selector.select(hidden, logits.view(B, K, -1), anchor)[0]

    def sampled_block_drafts(self, hidden: torch.Tensor, anchor: torch.Tensor, lm_head: nn.Module,
                             temperature: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's sampled pass over the whole vocabulary's logits, noise [B, K, top_k] Exp(1) -> (drafts
        [B, K], q [B, K, V]: each draft's distribution, zero outside its position's candidates); rows with
        temperature 0 keep the greedy pick."""
        B, K, H = hidden.shape
        logits = self.compute_logits(hidden.reshape(B * K, H), lm_head).view(B, K, -1)
        drafts, cand, q = self.candidate_selector.select(hidden, logits, anchor, temperature, noise)
        assert q is not None
        return drafts, torch.zeros_like(logits).scatter_(2, cand, q)
