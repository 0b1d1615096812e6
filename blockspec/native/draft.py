"""A DFlash drafter on the native kernels (draft.c, decoder.c): what a q4 target on the native decoder stack drafts
with. Its linears as GGUF Q8_0 blocks (fc, each layer's q|k|v, o, gate|up, down), int8 activations; the block's
forward is decoder.c's stack with a draft batch (each row over its sequence's cached draft context and its whole
block) and the context append is one draft.c call. On SmolLM2-135M's bundled drafter this replaces ~60 eager torch
ops per draft layer and the bf16 oneDNN GEMMs (docs/perf.md, "native drafter").

The drafts are those of the Q8_0 drafter (not bit for bit the bf16 or fp32 drafter's): speculation stays lossless,
only which tokens get proposed can differ. The torch modules are kept as they are for any other attention."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from blockspec.attention.paged_ref import PagedBatch
from blockspec.kv.pool import KVPool
from blockspec.layers import cpu_quant
from blockspec.native import q4
from blockspec.native.decoder import NativeStack, _Dims, _Layer, _Weight, _ptr


class _ContextBatch(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int), ("n_taps", ctypes.c_int), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("slot_mapping", ctypes.c_void_p)]


class _Q8:
    """One linear's weight [N, K] (+ bias) as Q8_0 blocks, and its _Weight view."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.w = q4.Q8Weights(*cpu_quant.q8_0_quantize(weight))
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.view = _Weight(_ptr(self.w.packed), _ptr(self.w.d), None, _ptr(self.bias), self.w.N, self.w.K, 8)


class NativeDraft(NativeStack):
    """The drafter's weights for draft.c / decoder.c; the model's own parameters are left untouched."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        self.layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            att, mlp = layer.self_attn, layer.mlp
            lin = [_Q8(att.qkv_proj.weight, att.qkv_proj.bias), _Q8(att.o_proj.weight, att.o_proj.bias),
                   _Q8(mlp.gate_up_proj.weight, mlp.gate_up_proj.bias), _Q8(mlp.down_proj.weight, mlp.down_proj.bias)]
            norms = [self._f32(n.weight) for n in (layer.input_layernorm, layer.post_attention_layernorm, att.q_norm,
                                                   att.k_norm)]
            self.keep += lin
            self.layers[i] = _Layer(*norms, *(q.view for q in lin), None, None)
        self.fc = _Q8(model.fc.weight, None)
        self.hidden_norm, self.final_norm = self._f32(model.hidden_norm.weight), self._f32(model.norm.weight)
        Hq, Hkv = model.layers[0].self_attn.qkv_proj.num_heads, model.layers[0].self_attn.qkv_proj.num_kv_heads
        self.dims = _Dims(cfg.hidden_size, Hq, Hkv, cfg.head_dim, cfg.intermediate_size, len(model.layers),
                          cfg.rms_norm_eps, cfg.head_dim ** -0.5, 1, q4.best_path())

    @staticmethod
    def runs(model: nn.Module) -> bool:
        """Whether draft.c computes this drafter: DFlash 1 (DFlash 2's convolutions and selector are not there),
        every layer non-causal without a window, fp32, dims in whole blocks of 32 and groups of 8."""
        from blockspec.models.dflash import DFlashDraftModel, DFlashLayer

        cfg = model.config
        return (q4.library() is not None and type(model) is DFlashDraftModel
                and all(type(layer) is DFlashLayer for layer in model.layers)
                and not any(cfg.layer_causal) and all(w is None for w in cfg.layer_window)
                and model.norm.weight.dtype == torch.float32 and model.norm.weight.device.type == "cpu"
                and all(n % q4.QK == 0 for n in (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size))
                and (cfg.num_key_value_heads * cfg.head_dim) % 8 == 0)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, batch: PagedBatch,
                outputs: tuple[int, int] | None = None) -> torch.Tensor:
        """h [T, H] (the scaled embeddings of the blocks' rows), cos/sin [T, 1, D], the draft pool and the blocks'
        batch (its kv_lens: each block's start) -> final-normed hidden [T, H]; outputs (a, b): only rows a..b-1 of
        each block are computed through the last layer (a K = 3 step reads 3 of 16), the others are zeros."""
        last_rows = None
        if outputs is not None:
            last_rows = (batch.query_start[:-1, None].long() + torch.arange(*outputs)).flatten()
        return self.run(h, cos, sin, pool, batch, (pool.draft_k, pool.draft_v), (), draft_block=True,
                        last_rows=last_rows)[0]

    def context(self, taps: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_k: list[torch.Tensor],
                pool_v: list[torch.Tensor], slots: torch.Tensor) -> None:
        """taps [T, n_taps * H] of committed rows, their rotary cos/sin [T, 1, D] -> every layer's k / v written
        into pool_k[layer] / pool_v[layer] [slots, Hkv, D] (fp32) at `slots` [T] (-1: skipped)."""
        T = taps.shape[0]
        self.bind(pool_k, pool_v)
        keep = [taps.float().contiguous(), cos.reshape(T, -1).float().contiguous(),
                sin.reshape(T, -1).float().contiguous(), slots.to(torch.int64).contiguous()]
        cb = _ContextBatch(T, keep[0].shape[1] // self.dims.hidden, *(_ptr(t) for t in keep[1:]))
        self.dims.threads = torch.get_num_threads()
        if q4.library().draft_context(ctypes.byref(self.dims), self.layers, ctypes.byref(self.fc.view),
                                      ctypes.c_void_p(self.hidden_norm), ctypes.byref(cb),
                                      ctypes.c_void_p(keep[0].data_ptr())) != 0:
            raise MemoryError("the native drafter could not allocate its scratch memory")
