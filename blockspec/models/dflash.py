"""The DFlash block-diffusion draft model (z-lab checkpoint format, loaded as-is).

A Qwen3-style stack whose attention takes Q from the block only and K/V from [context ; block]. Context features
(the target's tapped residual streams) go through fc -> hidden_norm once, then each layer's own k/v projection; those
context K/V depend only on committed tokens, so they are computed once per token and cached. Block K/V live for one
pass. The draft has no embedding or lm_head: the target's are passed in (models/dflash_io.py).

Each layer's q_proj / k_proj / v_proj are packed into one qkv_proj at load (models/qkv.py); what runs on this
platform (the CPU-packed variants, the drafter's own heads) is picked once at load by loading/prepare.py."""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn

from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.base import PagedDest, packed_shard_sizes
from blockspec.models.dflash_config import DFlashConfig
from blockspec.models.dflash_io import DraftHead
from blockspec.models.decoder import MLP
from blockspec.models.executor import DraftStackExecutor
from blockspec.models.qkv import KV, ContextKV, LinearQKV, QKVProjection


class DraftAttentionFn(Protocol):
    """Attention of block queries over the cached context of this draft layer plus the block's own k/v."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
        window: int | None,
    ) -> torch.Tensor: ...


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        Hq, D = cfg.num_attention_heads, cfg.head_dim
        self.qkv_proj: QKVProjection = LinearQKV(cfg.hidden_size, Hq, cfg.num_key_value_heads, D, cfg.attention_bias)
        self.o_proj = nn.Linear(Hq * D, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.causal = cfg.layer_causal[layer_idx]
        self.window = cfg.layer_window[layer_idx]
        self.scale = D**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: DraftAttentionFn) -> torch.Tensor:
        q, k, v = self.qkv_proj(x, self.q_norm, self.k_norm, cos, sin)
        out = attn(self.layer_idx, q, k, v, self.scale, self.causal, self.window)
        return self.o_proj(out.flatten(1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # type: ignore[arg-type]  (needs hidden_size / intermediate_size only)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: DraftAttentionFn, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's output delta (None before layer 0) -> (h, this layer's
        output); each residual add is fused with the norm that follows it (one kernel on GPU, same sums). rows: the
        rows of one draft block (a DFlash 1 layer treats rows alone, so it ignores it; DFlash 2's convolutions
        need it)."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add_forward(delta, h)
        x, h = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, attn), h)
        return h, self.mlp(x)


class DFlashDraftModel(nn.Module):
    layer_class: type[DFlashLayer] = DFlashLayer  # DFlash 2 (models/dflash2.py) adds convolutions to the layer
    # checkpoint names -> (our packed parameter, shard index), as the target's (models/decoder.py)
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: DFlashConfig, num_taps: int) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # The variants below are replaced once at load where the platform asks (loading/prepare.py).
        self.context_proj: ContextKV = ContextKV()  # every layer's context k/v, layer by layer
        # taps and embeddings as they come: training passes its autocast dtype and must keep it
        self.input_cast: nn.Module = nn.Identity()
        self.head: DraftHead = DraftHead()  # compute_logits: the target's lm_head
        self.greedy_head: DraftHead = DraftHead()  # greedy_drafts: the target's lm_head
        # runs the layer stack and the context append in one call each where it can (the native drafter under a
        # native q4 target: loading/native_stack.py attaches it)
        self.executor: DraftStackExecutor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's activations and of its context K/V."""
        return self.norm.weight.dtype

    def shard_sizes(self, param: str) -> list[int]:
        """Row sizes of the shards packed into a fused parameter (for the loader and the export)."""
        return packed_shard_sizes(self.config, param)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor, paged: Callable[[int], PagedDest] | None = None
                   ) -> list[KV]:
        """taps [N, num_taps*H] of committed tokens at `positions` [N] -> per draft layer (k, v) [N, Hkv, D].
        paged(layer) -> (k_cache, v_cache, slot_mapping): where the fused GPU path may write them itself (a
        layer's (k, v) is (None, None) then; the caller stores the others)."""
        if self.executor is not None and paged is not None:
            if self.executor.write_context(taps, positions, self.rotary, paged):
                return [(None, None)] * len(self.layers)
        ctx = self.hidden_norm(self.fc(self.input_cast(taps)))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        attns = [layer.self_attn for layer in self.layers]
        return self.context_proj(ctx, cos, sin, [a.qkv_proj for a in attns], [a.k_norm for a in attns], paged)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attn: DraftAttentionFn,
                rows: int | None = None, outputs: tuple[int, int] | None = None) -> torch.Tensor:
        """embeds [T, H] (raw target embeddings of T / rows blocks of `rows` rows each; None: T rows of one block or
        of blocks whose bounds the layers need not know; scaled here), positions [T] -> final-normed [T, H].
        outputs (a, b): the caller reads rows a..b-1 of each block only; an executor may then skip the other rows'
        last-layer attention and MLP and return zeros there (the torch layers compute every row)."""
        embeds = self.input_cast(embeds)
        h = embeds * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else embeds
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        ran = self.executor.run_layers(h, cos, sin, attn, outputs) if self.executor is not None else None
        if ran is not None:
            return ran
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, attn, rows or h.shape[0])
        return self.norm.add_forward(delta, h)[0]

    def block_drafts(self, hidden: torch.Tensor, anchor: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Greedy drafts [B, K] of blocks whose final hidden states at the draft positions are hidden [B, K, H] and
        whose bonus tokens are anchor [B]: DFlash 1 drafts each position's argmax, whatever the anchor."""
        B, K, H = hidden.shape
        return self.greedy_drafts(hidden.reshape(B * K, H), lm_head).view(B, K)

    def greedy_drafts(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Argmax drafts [rows] of compute_logits, over the token ids < draft_vocab_size when a smaller head was set.
        Without multiplier or softcap the fp32 copy of [rows, vocab] logits cannot change the argmax (the cast is
        exact), so it is skipped. max().indices is argmax (the first maximum on ties), about 3x faster on CPU."""
        logits = self.greedy_head(hidden, lm_head)
        if self.config.output_multiplier != 1.0 or self.config.final_logit_softcapping:
            logits = self._scale_logits(logits.float())
        return logits.max(-1).indices

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """fp32 draft logits [rows, vocab] over the whole vocabulary (through the drafter's own copy of the head if
        it has one, else through `lm_head`, the target's)."""
        return self._scale_logits(self.head(hidden, lm_head).float())

    def _scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
