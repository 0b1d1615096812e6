"""The native kernels loaded with ctypes (build.py compiles them): every exported function's argument and result types
declared once at load (so a wrong argument fails in Python, not in the kernel, and calls cost no more per step), and
the struct mirrors checked against the library's own layout (structs.py).

BLOCKSPEC_NATIVE: "0" (or "off", "false", "no") never builds nor loads them: library() is None and --cpu-quant runs
torch's kernels; anything else, or unset, builds them on first use (build.py says where, and how a failure is kept)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

from blockspec.native import build, structs

log = logging.getLogger("blockspec.native")
OFF = ("0", "off", "false", "no")

_P, _I = ctypes.c_void_p, ctypes.c_int
_DIMS, _LAYERS = ctypes.POINTER(structs.Dims), ctypes.POINTER(structs.Layer)
# name -> (restype, argtypes), as declared in the C files; every function the library exports (the build test checks
# the list against the library's symbols). Pointers to tensors are c_void_p: callers pass data_ptr() ints.
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "fp16_to_f32": (ctypes.c_float, [ctypes.c_uint16]),
    "q8_quantize_blocks": (None, [_P, _I, _P, _P, _P]),
    "q8_quantize_rows": (None, [_P, _I, _I, _P, _P, _P]),
    "q4_pack": (None, [_P, _I, _I, _P]),
    "q4_best_path": (_I, []),
    "q4_gemm_groups": (None, [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _I, _I, _I]),
    "q4_gemm": (None, [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _I, _I]),
    "q8w_pack": (None, [_P, _I, _I, _P]),
    "q8_gemm_groups": (None, [_P, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I]),
    "q8_gemm": (None, [_P, _P, _I, _I, _P, _P, _I, _P, _I, _I]),
    "amx_available": (_I, []),
    "q4_pair_amx": (None, [_P, _P, _P, _I, _P, _P, _P, _I, _I, _P, _I, _I]),
    "q8_pair_amx": (None, [_P, _P, _I, _P, _P, _I, _I, _P, _I, _I]),
    "decoder_forward": (_I, [_DIMS, _LAYERS, _P, ctypes.POINTER(structs.Batch), _P, _P]),
    "draft_context": (_I, [_DIMS, _LAYERS, ctypes.POINTER(structs.Weight), _P, ctypes.POINTER(structs.ContextBatch),
                           _P]),
    "native_layout": (ctypes.c_longlong, [ctypes.c_char_p]),
}


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with its functions typed and its structs checked (structs.LayoutMismatch)."""
    dll = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = restype, argtypes
    structs.check_layout(dll)
    return dll


@functools.lru_cache(maxsize=None)
def _state() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) or (None, why there is none)."""
    if os.environ.get("BLOCKSPEC_NATIVE", "1").strip().lower() in OFF:
        return None, f"BLOCKSPEC_NATIVE={os.environ['BLOCKSPEC_NATIVE']}"
    built = build.build()
    if built.library is None:
        return None, built.reason
    try:
        return load(built.library), None
    except OSError as e:  # a damaged or foreign file under the cache's key
        reason = f"{built.library} does not load: {e}"
        log.warning("blockspec: the native CPU kernels are not loaded (%s); --cpu-quant runs torch's kernels "
                    "instead. Delete %s to build them again.", reason, built.library.parent)
        return None, reason


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built once per source version, compiler and machine (a few seconds), or None where they
    cannot be built or are switched off (unavailable_reason says why)."""
    return _state()[0]


def unavailable_reason() -> str | None:
    """Why library() is None (one line: the compiler's error, no compiler, BLOCKSPEC_NATIVE=0), or None."""
    return _state()[1]


@functools.lru_cache(maxsize=None)
def best_path() -> int:
    """3: AMX-INT8 tiles for calls of 8+ rows (else AVX512-VNNI), 2: AVX512-VNNI, 1: AVX2 (with FMA and F16C),
    0: scalar (all give the same bits); -1 without the library."""
    lib = library()
    return lib.q4_best_path() if lib is not None else -1
