"""A q4 target's decoder stack in one native call per forward (decoder.c): what `--cpu-quant q4` runs on the CPU where
the kernels build. The embedding lookup, the rotary table and the logits stay in torch (one op each); everything
between them, 30 layers of ~60 eager ops each on SmolLM2-135M, is one call (docs/perf.md, "The native decoder").

`NativeDecoder.attach(model)` hangs one on a DecoderForCausalLM whose every layer it can run (the dense family
layer, q4 linears on the native kernel, no MLP biases); the model's forward then hands it the paged pool and batch
of a RowwiseTargetAttention. Other attentions (the dense cache of the reference paths, the drafter's pool) keep the
torch layers, which compute the same function to within the int8 rounding of the activations."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from blockspec.native import q4

if TYPE_CHECKING:
    from blockspec.attention.paged_ref import PagedBatch
    from blockspec.kv.pool import KVPool


class _Weight(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("N", ctypes.c_int), ("K", ctypes.c_int), ("bits", ctypes.c_int)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight),
                ("down", _Weight), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int), ("layers", ctypes.c_int),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("threads", ctypes.c_int), ("path", ctypes.c_int)]


class _Batch(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("positions", ctypes.c_void_p), ("slot_mapping", ctypes.c_void_p), ("row_seq", ctypes.c_void_p),
                ("kv_lens", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int),
                ("block_size", ctypes.c_int), ("tap_layers", ctypes.c_void_p), ("n_taps", ctypes.c_int),
                ("query_start", ctypes.c_void_p), ("last_rows", ctypes.c_void_p), ("n_last", ctypes.c_int)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(linear: nn.Module) -> _Weight:
    """A NativeQ4Linear's or NativeQ8Linear's weight as decoder.c reads it."""
    w = linear.weights
    m = getattr(w, "m", None)  # Q8_0 has none
    return _Weight(_ptr(w.packed), _ptr(w.d), _ptr(m), _ptr(linear.bias), w.N, w.K, 4 if m is not None else 8)


class NativeStack:
    """What decoder.c runs for a model: its layers' weight addresses (`layers`, kept alive by the model's modules and
    `keep`), final norm and dims; `run` is one forward of a paged batch."""

    layers: ctypes.Array
    dims: _Dims
    final_norm: int

    def __init__(self) -> None:
        self.keep: list[object] = []  # what the C structs point into, besides the model's own tensors

    def _f32(self, w: torch.Tensor) -> int:
        """An fp32 contiguous copy of w, kept alive here; its address."""
        t = w.detach().float().contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def bind(self, k_caches: torch.Tensor, v_caches: torch.Tensor) -> None:
        """Point each layer at its [slots, Hkv, D] fp32 k / v caches (k_caches[i], v_caches[i])."""
        for i in range(len(self.layers)):
            self.layers[i].k_cache, self.layers[i].v_cache = k_caches[i].data_ptr(), v_caches[i].data_ptr()

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
        h = x.float().clone().contiguous()
        taps = torch.empty(T, len(tap_layers) * H) if tap_layers else None
        self.bind(*caches)
        counts = batch.query_start[1:] - batch.query_start[:-1]
        row_seq = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts.long())
        keep = [cos.reshape(T, -1).float().contiguous(), sin.reshape(T, -1).float().contiguous(),
                batch.positions.to(torch.int64).contiguous(), batch.slot_mapping.to(torch.int64).contiguous(),
                row_seq, batch.kv_lens.to(torch.int32).contiguous(), batch.block_tables.to(torch.int64).contiguous(),
                torch.tensor(list(tap_layers), dtype=torch.int32), batch.query_start.to(torch.int32).contiguous(),
                None if last_rows is None else last_rows.to(torch.int32).contiguous()]
        b = _Batch(T, *(_ptr(t) for t in keep[:7]), keep[6].shape[1], pool.block_size, _ptr(keep[7]),
                   len(tap_layers), _ptr(keep[8]) if draft_block else None, _ptr(keep[9]),
                   0 if last_rows is None else len(last_rows))
        self.dims.threads = torch.get_num_threads()
        if q4.library().decoder_forward(ctypes.byref(self.dims), self.layers, ctypes.c_void_p(self.final_norm),
                                        ctypes.byref(b), ctypes.c_void_p(h.data_ptr()),
                                        ctypes.c_void_p(_ptr(taps))) != 0:
            raise MemoryError("the native layer stack could not allocate its scratch memory")
        return h, taps


class NativeDecoder(NativeStack):
    """The layer stack of one q4 model for decoder.c."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        self.layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            att, mlp = layer.self_attn, layer.mlp
            norm = lambda m: None if m is None else self._f32(m.weight)  # noqa: E731
            self.layers[i] = _Layer(norm(layer.input_layernorm), norm(layer.post_attention_layernorm),
                                    norm(att.q_norm), norm(att.k_norm), _weight(att.qkv_proj), _weight(att.o_proj),
                                    _weight(mlp.gate_up_proj), _weight(mlp.down_proj), None, None)
        self.final_norm = self._f32(model.norm.weight)
        first = model.layers[0].self_attn
        self.dims = _Dims(cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim, cfg.intermediate_size,
                          len(model.layers), cfg.rms_norm_eps, first.scale, 1, q4.best_path())

    @staticmethod
    def runs(model: nn.Module) -> bool:
        """Whether every layer of `model` is one decoder.c computes: the shared dense layer, each linear on the
        native q4 kernel, fp32, no MLP biases (no family has them with q4 yet), heads of whole int8 blocks (the
        attention quantizes each head's output itself)."""
        from blockspec.layers.cpu_quant import NativeQ4Linear
        from blockspec.models.decoder import DecoderLayer

        def linears(layer: nn.Module) -> list[nn.Module]:
            a, m = layer.self_attn, layer.mlp
            return [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]

        layers = getattr(model, "layers", None)
        # NativeQ4Linear exists only where the library built: nothing here builds it (a q8 target never does)
        return (layers is not None and len(layers) > 0 and model.config.head_dim % q4.QK == 0
                and all(type(layer) is DecoderLayer for layer in layers)
                and all(isinstance(lin, NativeQ4Linear) for layer in layers for lin in linears(layer))
                and all(layer.mlp.gate_up_proj.bias is None and layer.mlp.down_proj.bias is None for layer in layers)
                and model.norm.weight.dtype == torch.float32)

    def forward(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, batch: PagedBatch,
                tap_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """embeds [T, H], cos/sin [T, 1, D] (the rotary table), the fp32 pool and the batch's paged metadata ->
        (final-normed hidden [T, H], taps [T, len(tap_layers) * H] or None); stores the rows' k/v in the pool."""
        return self.run(embeds, cos, sin, pool, batch, (pool.k, pool.v), tap_layers, draft_block=False)
