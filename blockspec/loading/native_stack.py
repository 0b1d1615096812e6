"""The native layer stacks (blockspec/native/decoder.c, draft.c) as the models' layer-stack executors
(models/executor.py): the weight addresses built from a loaded model, the cache binding, one call per forward.

The target: a q4 model's whole stack in one native call (what `--cpu-quant q4` runs on the CPU where the kernels build).
The embedding lookup, the rotary table and the logits stay in torch (one op each); everything between them, 30 layers
of ~60 eager ops each on SmolLM2-135M, is one call (docs/results/2026-12-06-cpu-native-decoder-stack.md). It runs the
paged pool and
batch of a RowwiseTargetAttention; other attentions (the dense cache of the reference paths) keep the torch layers,
which compute the same function to within the int8 rounding of the activations.

The drafter: a DFlash 1 drafter under such a target, its linears as GGUF Q8_0 blocks (fc, each layer's q|k|v, o,
gate|up, down) and int8 activations; the block's forward is decoder.c's stack with a draft batch (each row over its
sequence's cached draft context and its whole block) and the context append is one draft.c call. On SmolLM2-135M's
bundled drafter this replaces ~60 eager torch ops per draft layer and the bf16 oneDNN GEMMs
(docs/results/2026-12-06-cpu-native-drafter-amx.md, "native
drafter"). Its drafts are those of the Q8_0 drafter (not bit for bit the bf16 or fp32 drafter's): speculation stays
lossless, only which tokens get proposed can differ. The torch modules are kept as they are for any other attention.

attach_target / attach_draft hang one on a model where it runs every layer; target_fallback / draft_fallback say why
not (None: it runs), in a few words for the platform report."""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

import torch
from torch import nn

from blockspec.attention.paged_ref import PagedBatch, PagedDraftAttention, RowwiseTargetAttention
from blockspec.kv.pool import KVPool
from blockspec.layers import cpu_quant
from blockspec.layers.rotary import RotaryEmbedding
from blockspec.models.base import AttentionFn, PagedDest
from blockspec.models.decoder import DecoderLayer
from blockspec.models.dflash import DFlashDraftModel, DFlashLayer
from blockspec.native import lib, q4
from blockspec.native.structs import Batch, ContextBatch, Dims, Layer, Weight


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(w: q4.Q4Weights | q4.Q8Weights, bias: torch.Tensor | None) -> Weight:
    """Packed weights (and an fp32 bias) as decoder.c reads them; the caller keeps the tensors alive."""
    m = getattr(w, "m", None)  # Q8_0 has none
    return Weight(_ptr(w.packed), _ptr(w.d), _ptr(m), _ptr(bias), w.N, w.K, 4 if m is not None else 8)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous array of dtype: itself where it is one already (the usual case: a conversion that changes
    nothing still costs a torch call, and a step makes ~30 of them)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _layer_addresses(caches: Sequence[torch.Tensor], n: int) -> tuple[int, ...]:
    """The address of caches[i], i < n: from the base and stride of one stacked [layers, ...] tensor, else each
    tensor's own."""
    if isinstance(caches, torch.Tensor):
        base, step = caches.data_ptr(), caches.stride(0) * caches.element_size()
        return tuple(base + i * step for i in range(n))
    return tuple(caches[i].data_ptr() for i in range(n))


class _Q8:
    """One drafter linear's weight [N, K] (+ bias) as Q8_0 blocks, and its Weight view."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.w = q4.Q8Weights(*cpu_quant.q8_0_quantize(weight))
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.view = _weight(self.w, self.bias)


class NativeStack:
    """What decoder.c runs for a model: its layers' weight addresses (`layers`, kept alive by the model's modules and
    `keep`), final norm and dims; `run` is one forward of a paged batch."""

    layers: ctypes.Array
    dims: Dims
    final_norm: int

    def __init__(self) -> None:
        self.keep: list[object] = []  # what the C structs point into, besides the model's own tensors
        self._bound: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # the caches `layers` point at
        self._tap_ids: dict[tuple[int, ...], torch.Tensor] = {}

    def _taps(self, tap_layers: Sequence[int]) -> torch.Tensor:
        """The tap layers as the int32 array decoder.c reads (made once per set)."""
        key = tuple(tap_layers)
        if key not in self._tap_ids:
            self._tap_ids[key] = torch.tensor(key, dtype=torch.int32)
        return self._tap_ids[key]

    def _f32(self, w: torch.Tensor) -> int:
        """An fp32 contiguous copy of w, kept alive here; its address."""
        t = w.detach().float().contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _layer(self, layer: nn.Module, linears: Sequence[Weight]) -> Layer:
        """A layer's norms (q / k head norms where it has them) and its qkv, o, gate_up and down weights."""
        att = layer.self_attn
        norms = [None if n is None else self._f32(n.weight)
                 for n in (layer.input_layernorm, layer.post_attention_layernorm, att.q_norm, att.k_norm)]
        return Layer(*norms, *linears, None, None)

    def bind(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        """Point each layer at its [slots, Hkv, D] fp32 k / v caches (k_caches[i], v_caches[i]). The addresses are
        worked out without indexing the pool per layer (that was ~120 torch calls a forward of a 30-layer target,
        ~150 of the ~500 of a CPU K = 3 step) and written only when they change."""
        addresses = (_layer_addresses(k_caches, len(self.layers)), _layer_addresses(v_caches, len(self.layers)))
        if addresses == self._bound:
            return
        for i, (k, v) in enumerate(zip(*addresses)):
            self.layers[i].k_cache, self.layers[i].v_cache = k, v
        self._bound = addresses

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, batch: PagedBatch,
            caches: tuple[torch.Tensor, torch.Tensor], tap_layers: Sequence[int], draft_block: bool,
            last_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H] in, cos/sin [T, 1, D], the layers' caches in `pool` -> (final-normed hidden [T, H], taps
        [T, len(tap_layers) * H] or None). draft_block: the batch's rows are draft blocks (each row sees its
        sequence's kv_len cached keys and its whole block, whose k/v are not stored); else target rows, stored at
        their slots and causal over the pool. last_rows [n] (ascending, no taps): only these rows' outputs are
        computed through the last layer's attention and MLP; the other rows of the result are zeros."""
        T, H = x.shape
        if last_rows is not None and tap_layers:
            raise ValueError("last_rows leaves rows out of the last layer, whose output a tap would read")
        h = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        taps = torch.empty(T, len(tap_layers) * H) if tap_layers else None
        self.bind(*caches)
        query_start = _as(batch.query_start, torch.int32)
        row_seq = torch.repeat_interleave(query_start.diff()).int()  # each row's sequence
        keep = [_as(cos.reshape(T, -1), torch.float32), _as(sin.reshape(T, -1), torch.float32),
                _as(batch.positions, torch.int64), _as(batch.slot_mapping, torch.int64), row_seq,
                _as(batch.kv_lens, torch.int32), _as(batch.block_tables, torch.int64), self._taps(tap_layers),
                query_start, None if last_rows is None else _as(last_rows, torch.int32)]
        b = Batch(T, *(_ptr(t) for t in keep[:7]), keep[6].shape[1], pool.block_size, _ptr(keep[7]),
                  len(tap_layers), _ptr(keep[8]) if draft_block else None, _ptr(keep[9]),
                  0 if last_rows is None else len(last_rows))
        self.dims.threads = torch.get_num_threads()
        if q4.library().decoder_forward(ctypes.byref(self.dims), self.layers, self.final_norm, ctypes.byref(b),
                                        h.data_ptr(), _ptr(taps)) != 0:
            raise MemoryError("the native layer stack could not allocate its scratch memory")
        return h, taps


class NativeDecoder(NativeStack):
    """The layer stack of one q4 target for decoder.c (a TargetStackExecutor)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        self.layers = (Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            att, mlp = layer.self_attn, layer.mlp
            self.layers[i] = self._layer(layer, [_weight(lin.weights, lin.bias) for lin in (
                att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)])
        self.final_norm = self._f32(model.norm.weight)
        first = model.layers[0].self_attn
        self.dims = Dims(cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim, cfg.intermediate_size,
                         len(model.layers), cfg.rms_norm_eps, first.scale, 1, q4.best_path())

    def forward(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, batch: PagedBatch,
                tap_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """embeds [T, H], cos/sin [T, 1, D] (the rotary table), the fp32 pool and the batch's paged metadata ->
        (final-normed hidden [T, H], taps [T, len(tap_layers) * H] or None); stores the rows' k/v in the pool."""
        return self.run(embeds, cos, sin, pool, batch, (pool.k, pool.v), tap_layers, draft_block=False)

    def run_layers(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                   tap_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """TargetStackExecutor: the stack over a row-wise paged attention's fp32 CPU pool (each row computed alone,
        as that attention does), else None."""
        paged = attn.native_paged if isinstance(attn, RowwiseTargetAttention) else None
        return None if paged is None else self.forward(embeds, cos, sin, *paged, tap_layers)


class NativeDraft(NativeStack):
    """A DFlash 1 drafter's weights for draft.c / decoder.c (a DraftStackExecutor); the model's own parameters are
    left untouched."""

    def __init__(self, model: DFlashDraftModel) -> None:
        super().__init__()
        cfg = model.config
        self.layers = (Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            att, mlp = layer.self_attn, layer.mlp
            lin = [_Q8(m.weight, m.bias) for m in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            self.keep += lin
            self.layers[i] = self._layer(layer, [q.view for q in lin])
        self.fc = _Q8(model.fc.weight, None)
        self.hidden_norm, self.final_norm = self._f32(model.hidden_norm.weight), self._f32(model.norm.weight)
        Hq, Hkv = model.layers[0].self_attn.qkv_proj.num_heads, model.layers[0].self_attn.qkv_proj.num_kv_heads
        self.dims = Dims(cfg.hidden_size, Hq, Hkv, cfg.head_dim, cfg.intermediate_size, len(model.layers),
                         cfg.rms_norm_eps, cfg.head_dim ** -0.5, 1, q4.best_path())

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

    def context(self, taps: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_k: Sequence[torch.Tensor],
                pool_v: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
        """taps [T, n_taps * H] of committed rows, their rotary cos/sin [T, 1, D] -> every layer's k / v written
        into pool_k[layer] / pool_v[layer] [slots, Hkv, D] (fp32) at `slots` [T] (-1: skipped)."""
        T = taps.shape[0]
        self.bind(pool_k, pool_v)
        keep = [_as(taps, torch.float32), _as(cos.reshape(T, -1), torch.float32),
                _as(sin.reshape(T, -1), torch.float32), _as(slots, torch.int64)]
        cb = ContextBatch(T, keep[0].shape[1] // self.dims.hidden, *(_ptr(t) for t in keep[1:]))
        self.dims.threads = torch.get_num_threads()
        if q4.library().draft_context(ctypes.byref(self.dims), self.layers, ctypes.byref(self.fc.view),
                                      self.hidden_norm, ctypes.byref(cb), keep[0].data_ptr()) != 0:
            raise MemoryError("the native drafter could not allocate its scratch memory")

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Callable[..., torch.Tensor],
                   outputs: tuple[int, int] | None) -> torch.Tensor | None:
        """DraftStackExecutor: the blocks over a paged draft attention's fp32 CPU pool, else None."""
        paged = attn.native_paged if isinstance(attn, PagedDraftAttention) else None
        return None if paged is None else self.forward(h, cos, sin, *paged, outputs=outputs)

    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      paged: Callable[[int], PagedDest]) -> bool:
        """DraftStackExecutor: the context append where the draft caches are fp32 on the CPU."""
        dests = [paged(layer) for layer in range(len(self.layers))]
        first = dests[0][0]
        if first.device.type != "cpu" or first.dtype != torch.float32:
            return False
        cos, sin = rotary.cos_sin(positions, torch.float32)
        self.context(taps, cos, sin, [k for k, _, _ in dests], [v for _, v, _ in dests], dests[0][2])
        return True


def _not_built() -> str | None:
    if q4.library() is not None:
        return None
    return f"the native kernels are not built here ({lib.unavailable_reason() or 'no library'})"


def target_fallback(model: nn.Module) -> str | None:
    """None where decoder.c computes every layer of `model`: the shared dense layer, each linear on the native q4
    kernel, fp32, no MLP biases (no family has them with q4 yet), heads of whole int8 blocks (the attention quantizes
    each head's output itself); else why not."""
    layers = getattr(model, "layers", None)
    if not layers:
        return "the model has no layer list"
    if model.config.head_dim % q4.QK:
        return f"head_dim {model.config.head_dim} is not a multiple of {q4.QK}"
    for i, layer in enumerate(layers):
        if type(layer) is not DecoderLayer:
            return f"layer {i} is a {type(layer).__name__}, not the shared dense layer"
        a, m = layer.self_attn, layer.mlp
        for name, lin in (("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up_proj", m.gate_up_proj),
                          ("down_proj", m.down_proj)):
            # NativeQ4Linear exists only where the library built: nothing here builds it (a q8 target never does)
            if not isinstance(lin, cpu_quant.NativeQ4Linear):
                return _not_built() or f"layer {i}'s {name} is a {type(lin).__name__}, not on the native q4 kernel"
        if m.gate_up_proj.bias is not None or m.down_proj.bias is not None:
            return f"layer {i}'s MLP has biases"
    if model.norm.weight.dtype != torch.float32:
        return f"the model is {model.norm.weight.dtype}, not fp32"
    return None


def draft_fallback(draft: nn.Module, target: nn.Module) -> str | None:
    """None where draft.c computes this drafter under `target`: a target on the native stack, DFlash 1 (DFlash 2's
    convolutions and selector are not there), every layer non-causal without a window, fp32 on the CPU, dims in whole
    blocks of 32 and groups of 8; else why not."""
    if not isinstance(getattr(target, "executor", None), NativeDecoder):
        return "the target is not on the native q4 stack"
    if (reason := _not_built()) is not None:
        return reason
    if type(draft) is not DFlashDraftModel or any(type(layer) is not DFlashLayer for layer in draft.layers):
        return f"{type(draft).__name__} is not a DFlash 1 drafter"
    cfg = draft.config
    if any(cfg.layer_causal) or any(w is not None for w in cfg.layer_window):
        return "the drafter has causal or windowed layers"
    weight = draft.norm.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return f"the drafter is {weight.dtype} on {weight.device.type}, not fp32 on the CPU"
    if any(n % q4.QK for n in (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size)):
        return (f"hidden, head and MLP sizes {cfg.hidden_size}, {cfg.head_dim}, {cfg.intermediate_size} are not "
                f"all multiples of {q4.QK}")
    if (cfg.num_key_value_heads * cfg.head_dim) % 8:
        return "the k / v width is not a multiple of 8"
    return None


def attach_target(model: nn.Module) -> str | None:
    """Hang the native stack on a q4 target (`model.executor`) where it runs; None, or why it does not."""
    reason = target_fallback(model)
    if reason is None:
        model.executor = NativeDecoder(model)
    return reason


def attach_draft(draft: DFlashDraftModel, target: nn.Module) -> str | None:
    """Hang the native drafter on `draft` (`draft.executor`) where it runs under `target`; None, or why it does not."""
    reason = draft_fallback(draft, target)
    if reason is None:
        draft.executor = NativeDraft(draft)
    return reason
