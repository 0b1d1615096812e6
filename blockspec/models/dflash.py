"""The DFlash block-diffusion draft model (z-lab checkpoint format, loaded as-is).

A Qwen3-style stack whose attention takes Q from the block only and K/V from [context ; block]. Context features
(the target's tapped residual streams) go through fc -> hidden_norm once, then each layer's own k_proj/v_proj; those
context K/V depend only on committed tokens, so they are computed once per token and cached. Block K/V live for one
pass. The draft has no embedding or lm_head: the target's are passed in (or copies of the latter made at load: the
packed head of the CPU fast path, the smaller head of draft_vocab_size)."""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers import kernels
from blockspec.layers.cpu_packed import PackedLinear, pack_linears
from blockspec.layers.norm import RMSNorm, rms_norm
from blockspec.layers.rotary import RotaryEmbedding, apply_rotary
from blockspec.models.dflash_config import DFlashConfig
from blockspec.models.llama import MLP


PagedDest = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (k_cache, v_cache [num_slots, Hkv, D], slot_mapping [N])


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
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.causal = cfg.layer_causal[layer_idx]
        self.window = cfg.layer_window[layer_idx]
        self.scale = self.head_dim**-0.5
        self.qkv_weight: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D, H] once fuse_qkv() ran (inference, GPU)
        self.qkv_packed: PackedLinear | None = None  # q|k|v in one packed linear once pack_cpu() ran
        self.qk_norm_weight: torch.Tensor | None = None  # [Hq + Hkv, D]: q_norm's weight per q head, then k_norm's

    def fuse_qkv(self) -> None:
        """Inference on GPU: q/k/v weights become views of one packed matrix, so the block's projection is one GEMM
        and its split + q/k norm + rotary one Triton kernel (as the target's layers). The checkpoint names stay."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if self.qkv_weight is not None or any(type(p) is not nn.Linear or p.bias is not None for p in projs):
            return  # already fused, or tensor-parallel shards / biases: the unfused path serves those
        w = torch.cat([p.weight.detach() for p in projs])
        sizes = [p.weight.shape[0] for p in projs]
        for p, part in zip(projs, w.split(sizes)):
            p.weight = nn.Parameter(part, requires_grad=False)
        self.qkv_weight = w

    def pack_cpu(self, rows_hint: int, dtype: torch.dtype) -> None:
        """CPU inference (DFlashDraftModel.pack_cpu): q/k/v as one packed GEMM. q_proj, k_proj and v_proj are
        dropped: the block uses the packed GEMM, the context k/v the model's all-layer one."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bias = None if self.q_proj.bias is None else torch.cat([p.bias for p in projs])
        self.qkv_packed = PackedLinear(torch.cat([p.weight for p in projs]), bias, dtype, rows_hint)
        D = self.head_dim
        self.qk_norm_weight = torch.cat([self.q_norm.weight.detach().expand(self.num_heads, D),
                                         self.k_norm.weight.detach().expand(self.num_kv_heads, D)])
        self.q_proj = self.k_proj = self.v_proj = None

    def _qkv_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The CPU packed path: one GEMM, then one norm and one rotary over the q and k heads together (per head the
        same arithmetic as q_norm / k_norm and apply_rotary, in fewer eager ops)."""
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_packed(x)
        qk = rms_norm(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), self.qk_norm_weight, self.q_norm.eps)
        qk = apply_rotary(qk, cos, sin)
        return qk[:, :Hq], qk[:, Hq:], qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)

    def _fused(self, x: torch.Tensor) -> bool:
        return (self.qkv_weight is not None and kernels.fused(x)
                and x.dtype == self.qkv_weight.dtype == self.q_norm.weight.dtype)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, paged: PagedDest | None = None
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x [N, H] -> k, v [N, Hkv, D] (k normed and rotated; v untouched). The fused path writes them into
        paged = (k_cache, v_cache, slot_mapping) when given, and returns (None, None)."""
        N = x.shape[0]
        if self._fused(x):
            from blockspec.layers.triton_qkv import split_qkv_norm_rope

            kv = F.linear(x, self.qkv_weight[self.num_heads * self.head_dim:])  # the k and v rows: no q heads
            _, k, v = split_qkv_norm_rope(kv, 0, self.num_kv_heads, self.head_dim, self.q_norm.weight,
                                          self.k_norm.weight, self.k_norm.eps, cos, sin, paged)
            return k, v
        k = self.k_norm(self.k_proj(x).view(N, self.num_kv_heads, self.head_dim))
        return apply_rotary(k, cos, sin), self.v_proj(x).view(N, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: DraftAttentionFn) -> torch.Tensor:
        T = x.shape[0]
        if self.qkv_packed is not None:
            q, k, v = self._qkv_packed(x, cos, sin)
        elif self._fused(x):
            from blockspec.layers.triton_qkv import split_qkv_norm_rope

            q, k, v = split_qkv_norm_rope(F.linear(x, self.qkv_weight), self.num_heads, self.num_kv_heads,
                                          self.head_dim, self.q_norm.weight, self.k_norm.weight, self.k_norm.eps,
                                          cos, sin)
        else:
            q = apply_rotary(self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim)), cos, sin)
            k, v = self.kv(x, cos, sin)
        out = attn(self.layer_idx, q, k, v, self.scale, self.causal, self.window)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # type: ignore[arg-type]  (needs hidden_size / intermediate_size only)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: DraftAttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h and the previous layer's output delta (None before layer 0) -> (h, this layer's
        output); each residual add is fused with the norm that follows it (one kernel on GPU, same sums)."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add_forward(delta, h)
        x, h = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, attn), h)
        return h, self.mlp(x)


class VocabPrefixHead(nn.Module):
    """Logits over the token ids < n only: the first n rows of an lm_head, as a view made once at load (a static
    weight for captured CUDA graphs; a non-persistent buffer, so .to(device) moves it with the drafter)."""

    def __init__(self, lm_head: nn.Linear, n: int) -> None:
        super().__init__()
        self.register_buffer("weight", lm_head.weight.detach()[:n], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DFlashDraftModel(nn.Module):
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: DFlashConfig, num_taps: int) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # Inference copies of the target's lm_head, made at load (None: drafts use the target's own head):
        self.draft_head: nn.Module | None = None  # the whole head (pack_cpu in another dtype than the target's)
        self.greedy_head: nn.Module | None = None  # argmax drafts: the first draft_vocab_size rows only
        # pack_cpu: every layer's context k|v in one packed GEMM, and the layers' k_norm weights [L, 1, D]
        self.ctx_kv_packed: PackedLinear | None = None
        self.ctx_k_norm_weight: torch.Tensor | None = None
        # inputs (taps, embeddings) are cast to this dtype (pack_cpu: e.g. bf16 under an fp32 target); None: used as
        # given (training passes its autocast dtype and must keep it)
        self.input_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's activations and of its context K/V."""
        return self.norm.weight.dtype

    @torch.no_grad()
    def pack_cpu(self, lm_head: nn.Module, dtype: torch.dtype, rows_hint: int, vocab: int | None = None) -> None:
        """CPU inference, once at load: weights in `dtype` with every linear packed for oneDNN (layers/cpu_packed.py),
        q/k/v of each layer in one GEMM, the context k/v of all layers in one GEMM; for the drafts a packed copy of
        the target's lm_head unless the head is already packed in `dtype` (the target keeps its head to verify), and
        of its first `vocab` rows for argmax drafts when given. rows_hint: rows of a draft block. Not undone."""
        self.to(dtype)
        attns = [layer.self_attn for layer in self.layers]
        kv = [p for a in attns for p in (a.k_proj, a.v_proj)]
        bias = None if kv[0].bias is None else torch.cat([p.bias for p in kv])
        self.ctx_kv_packed = PackedLinear(torch.cat([p.weight for p in kv]), bias, dtype, rows_hint)
        self.ctx_k_norm_weight = torch.stack([a.k_norm.weight.detach() for a in attns])[:, None]
        for a in attns:
            a.pack_cpu(rows_hint, dtype)
        pack_linears(self, dtype, rows_hint)  # fc, o_proj, the MLPs
        if not (isinstance(lm_head, PackedLinear) and lm_head.dtype == dtype):  # else the target's head serves
            self.draft_head = PackedLinear.from_linear(lm_head, dtype, rows_hint)
        if vocab is not None:
            self.greedy_head = PackedLinear(lm_head.weight[:vocab], None, dtype, rows_hint)
        self.input_dtype = dtype

    def set_draft_vocab(self, lm_head: nn.Linear, n: int) -> None:
        """Argmax drafts over the token ids < n only (SpeculativeConfig.draft_vocab_size), through a view of the
        first n rows of the target's lm_head."""
        self.greedy_head = VocabPrefixHead(lm_head, n)

    def shard_sizes(self, param: str) -> list[int]:
        return [self.config.intermediate_size, self.config.intermediate_size]

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor, paged: Callable[[int], PagedDest] | None = None
                   ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """taps [N, num_taps*H] of committed tokens at `positions` [N] -> per draft layer (k, v) [N, Hkv, D].
        paged(layer) -> (k_cache, v_cache, slot_mapping): where the fused GPU path may write them itself (a
        layer's (k, v) is (None, None) then; the caller stores the others)."""
        if self.input_dtype is not None:
            taps = taps.to(self.input_dtype)
        ctx = self.hidden_norm(self.fc(taps))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        if self.ctx_kv_packed is not None:  # CPU packed (`paged` is for the fused GPU prologue only)
            return self._context_kv_packed(ctx, cos, sin)
        return [layer.self_attn.kv(ctx, cos, sin, paged(i) if paged is not None else None)
                for i, layer in enumerate(self.layers)]

    def _context_kv_packed(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context k/v from one GEMM, one k-norm and one rotary (per layer the same arithmetic as
        DFlashAttention.kv)."""
        a = self.layers[0].self_attn
        L, N, Hkv, D = len(self.layers), ctx.shape[0], a.num_kv_heads, a.head_dim
        kv = self.ctx_kv_packed(ctx).view(N, L, 2, Hkv, D)
        k = rms_norm(kv[:, :, 0], self.ctx_k_norm_weight, a.k_norm.eps)
        k = apply_rotary(k, cos[:, None], sin[:, None])
        return [(k[:, i], kv[:, i, 1]) for i in range(L)]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attn: DraftAttentionFn) -> torch.Tensor:
        """embeds [T, H] (raw target embeddings of the block; scaled here), positions [T] -> final-normed [T, H]."""
        if self.input_dtype is not None:
            embeds = embeds.to(self.input_dtype)
        h = embeds * self.config.input_embedding_scale if self.config.input_embedding_scale != 1.0 else embeds
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, attn)
        return self.norm.add_forward(delta, h)[0]

    def fuse_qkv(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse_qkv()

    def greedy_drafts(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Argmax drafts [rows] of compute_logits, over the token ids < draft_vocab_size when a smaller head was set.
        Without multiplier or softcap the fp32 copy of [rows, vocab] logits cannot change the argmax (the cast is
        exact), so it is skipped. max().indices is argmax (the first maximum on ties), about 3x faster on CPU."""
        head = next(h for h in (self.greedy_head, self.draft_head, lm_head) if h is not None)
        logits = head(hidden)
        if self.config.output_multiplier != 1.0 or self.config.final_logit_softcapping:
            logits = self._scale_logits(logits.float())
        return logits.max(-1).indices

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """fp32 draft logits [rows, vocab] over the whole vocabulary (the drafter's own copy of the head if it has
        one, else `lm_head`, the target's)."""
        head = self.draft_head if self.draft_head is not None else lm_head
        return self._scale_logits(head(hidden).float())

    def _scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
