"""The ctypes mirrors of the C structs Python passes to the native library (native.h), and their check against the
layout the library reports (layout.c): a mirror that drifted from its struct fails at load, naming the struct and the
field, instead of handing the kernels shifted addresses."""

from __future__ import annotations

import ctypes

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class Weight(ctypes.Structure):
    """qweight: one linear's packed codes, fp16 d (and m for Q4_1) by group, optional fp32 bias."""

    _c_name_ = "qweight"
    _fields_ = [("packed", _P), ("d", _P), ("m", _P), ("bias", _P), ("N", _I), ("K", _I), ("bits", _I)]


class Layer(ctypes.Structure):
    """layer_weights: one decoder layer's norms, linears and k / v caches."""

    _c_name_ = "layer_weights"
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", Weight), ("o", Weight),
                ("gate_up", Weight), ("down", Weight), ("k_cache", _P), ("v_cache", _P)]


class Dims(ctypes.Structure):
    """decoder_dims: a stack's shapes, its norms' eps, the attention scale, the thread count and the kernel path."""

    _c_name_ = "decoder_dims"
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("intermediate", _I),
                ("layers", _I), ("eps", _F), ("scale", _F), ("threads", _I), ("path", _I)]


class Batch(ctypes.Structure):
    """decoder_batch: one forward's rows, their rotary tables, slots, sequences and block tables."""

    _c_name_ = "decoder_batch"
    _fields_ = [("T", _I), ("cos", _P), ("sin", _P), ("positions", _P), ("slot_mapping", _P), ("row_seq", _P),
                ("kv_lens", _P), ("block_tables", _P), ("max_blocks", _I), ("block_size", _I), ("tap_layers", _P),
                ("n_taps", _I), ("query_start", _P), ("last_rows", _P), ("n_last", _I)]


class ContextBatch(ctypes.Structure):
    """context_batch: the committed rows of a drafter's context append."""

    _c_name_ = "context_batch"
    _fields_ = [("T", _I), ("n_taps", _I), ("cos", _P), ("sin", _P), ("slot_mapping", _P)]


MIRRORS: tuple[type[ctypes.Structure], ...] = (Weight, Layer, Dims, Batch, ContextBatch)


class LayoutMismatch(RuntimeError):
    """A ctypes mirror differs from its C struct (the sources and this file were edited apart)."""


def check_layout(dll: ctypes.CDLL, mirrors: tuple[type[ctypes.Structure], ...] = MIRRORS) -> None:
    """Each mirror's size and field offsets against the library's native_layout table; raises LayoutMismatch."""
    for mirror in mirrors:
        name = mirror._c_name_  # type: ignore[attr-defined]
        size = dll.native_layout(name.encode())
        if size != ctypes.sizeof(mirror):
            raise LayoutMismatch(f"blockspec/native: struct {name} is {size} bytes in C but {ctypes.sizeof(mirror)} "
                                 f"in its mirror {mirror.__module__}.{mirror.__name__} (-1: not in layout.c)")
        for field, *_ in mirror._fields_:
            at = dll.native_layout(f"{name}.{field}".encode())
            if at != getattr(mirror, field).offset:
                raise LayoutMismatch(f"blockspec/native: field {name}.{field} is at offset {at} in C but "
                                     f"{getattr(mirror, field).offset} in {mirror.__name__} (-1: not in layout.c)")
