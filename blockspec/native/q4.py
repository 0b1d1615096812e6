"""The native Q4 x Q8 and Q8 x Q8 kernels (q4gemm.c, q8gemm.c beside this file) and the decoder stack and drafter
built on them (decoder.c / decoder.py, draft.c / draft.py):
compiled with the machine's C compiler on first use into the user cache (~/.cache/blockspec/native,
BLOCKSPEC_CACHE_DIR), loaded with ctypes. Written here because torch's
CPU int4 kernels dequantize to fp32 FMAs (each further 4-row block costs another pass) and take bf16 activations:
this one takes int8 activations with integer dot products and streams the weights once for all rows (docs/perf.md).
No compiler, a failed build or BLOCKSPEC_NATIVE=0: library() is None and --cpu-quant keeps torch's kernels."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(n) for n in ("q4gemm.c", "q8gemm.c", "amx.c", "decoder.c", "draft.c")]
HEADERS = [Path(__file__).with_name("native.h")]
# -ffp-contract=off: no multiply-add is fused in one place and not in another (decoder.c's exactness);
# -fno-math-errno, -fno-trapping-math: sqrtf and lrintf become single instructions and the loops with conversions and
# clamps (exp, SiLU) vectorize; neither lets the compiler change a result (no reassociation, no fast math)
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
QK = 32  # inputs per block


def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKSPEC_CACHE_DIR", Path.home() / ".cache" / "blockspec")) / "native"


def _cpu_flags() -> bytes:
    """The CPU's feature flags: the library is built for this machine's instruction set (-march=native), so a cache
    shared by two machines keeps one build each."""
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_bytes().splitlines() if ln.startswith(b"flags")), b"")
    except OSError:
        return b""


def _build(cc: str, lib: Path, flags: list[str]) -> bool:
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run([cc, *COMMON_FLAGS, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return False
    tmp.replace(lib)  # atomic: two processes building at once never load half a file
    return True


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built once per source version and machine (a few seconds), or None where they cannot
    be built."""
    if os.environ.get("BLOCKSPEC_NATIVE", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(COMMON_FLAGS).encode()
                            + _cpu_flags()).hexdigest()[:16]
    lib = cache_dir() / f"blockspec-native-{digest}.so"
    if not lib.is_file():
        if cc is None:
            return None
        lib.parent.mkdir(parents=True, exist_ok=True)
        # the SIMD paths carry their own target attributes; -march=native vectorizes decoder.c's loops; a compiler
        # without AMX intrinsics builds the other paths
        tries = (["-march=native"], ["-march=native", "-DBLOCKSPEC_NO_AMX"], [], ["-DBLOCKSPEC_NO_AMX"])
        if not any(_build(cc, lib, flags) for flags in tries):
            return None
    dll = ctypes.CDLL(str(lib))
    dll.q4_best_path.restype = ctypes.c_int
    dll.decoder_forward.restype = ctypes.c_int
    dll.draft_context.restype = ctypes.c_int
    return dll


@functools.lru_cache(maxsize=None)
def best_path() -> int:
    """3: AMX-INT8 tiles for calls of 8+ rows (else AVX512-VNNI), 2: AVX512-VNNI, 1: AVX2 (with FMA and F16C),
    0: scalar (all give the same bits)."""
    lib = library()
    return lib.q4_best_path() if lib is not None else -1


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class Q4Weights:
    """A weight [N, K] as the kernel reads it, from GGUF Q4_1 blocks: codes [N, K] (0..15) and per-block d, m
    [N, K / 32] (fp16), w = d * code + m. N a multiple of 8, K of 32."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        N, K = codes.shape
        self.N, self.K, self.KB = N, K, K // QK
        codes = codes.to(torch.uint8).contiguous()
        self.packed = torch.empty(N * K // 2, dtype=torch.uint8)
        library().q4_pack(_ptr(codes), N, K, _ptr(self.packed))
        self.d, self.m = (_by_group(v, N, self.KB) for v in (d, m))

    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.d.numel() + 2 * self.m.numel()

    def matmul(self, x: torch.Tensor, path: int | None = None) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32 (activations quantized per row and block of 32 to int8 inside)."""
        M = x.shape[0]
        qx, sx, xs = quantize_rows(x, self.KB)
        y = torch.empty(M, self.N)
        library().q4_gemm(_ptr(self.packed), _ptr(self.d), _ptr(self.m), self.N, self.K, _ptr(qx), _ptr(sx), _ptr(xs),
                          M, _ptr(y), torch.get_num_threads(), best_path() if path is None else path)
        return y


def _by_group(v: torch.Tensor, N: int, KB: int) -> torch.Tensor:
    """per-block fp16 values [N, KB] -> [N / 8, KB, 8]: a block's 8 outputs of a group load as one vector."""
    return v.to(torch.float16).view(N // 8, 8, KB).transpose(1, 2).contiguous()


def quantize_rows(x: torch.Tensor, KB: int) -> tuple[torch.Tensor, ...]:
    """x [M, K] fp32 -> (codes int8 [M, K], sx, xs [M, KB]): q4gemm.c's int8 activations."""
    M, K = x.shape
    x = x.contiguous()
    qx = torch.empty(M, K, dtype=torch.int8)
    sx, xs = torch.empty(M, KB), torch.empty(M, KB)
    library().q8_quantize_rows(_ptr(x), M, K, _ptr(qx), _ptr(sx), _ptr(xs))
    return qx, sx, xs


class Q8Weights:
    """A weight [N, K] as q8gemm.c reads it, from GGUF Q8_0 blocks: int8 codes [N, K] and per-block d [N, K / 32]
    (fp16), w = d * code. N a multiple of 8, K of 32."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor) -> None:
        N, K = codes.shape
        self.N, self.K, self.KB = N, K, K // QK
        self.packed = torch.empty(N * K, dtype=torch.int8)
        library().q8w_pack(_ptr(codes.to(torch.int8).contiguous()), N, K, _ptr(self.packed))
        self.d = _by_group(d, N, self.KB)

    def rows(self, n: int) -> "Q8Weights":
        """The first n outputs (a multiple of 8) as weights of their own: views of these (groups are stored one after
        another), no copy."""
        out = object.__new__(Q8Weights)
        out.N, out.K, out.KB = n, self.K, self.KB
        out.packed, out.d = self.packed[:n * self.K], self.d[:n // 8]
        return out

    def matmul(self, x: torch.Tensor, path: int | None = None) -> torch.Tensor:
        """x [M, K] fp32 -> [M, N] fp32 (activations quantized per row and block of 32 to int8 inside)."""
        M = x.shape[0]
        qx, sx, _ = quantize_rows(x, self.KB)
        y = torch.empty(M, self.N)
        library().q8_gemm(_ptr(self.packed), _ptr(self.d), self.N, self.K, _ptr(qx), _ptr(sx), M, _ptr(y),
                          torch.get_num_threads(), best_path() if path is None else path)
        return y
