"""The CPU linear kernels --cpu-quant chooses between, on SmolLM2-135M's shapes
(docs/results/2026-12-05-cpu-quant-llama-cpp.md): ms for the linears of
one forward (30 layers of q|k|v, o, gate|up, down, each layer its own weights so they stream from memory as in a
decode step; then the 49,152 x 576 head) at 1, 4, 5 and 16 rows (a decode step, a verify step of K = 3 and 4, a
draft block). Random weights; the kernels do not look at the values.
  f32 / bf16: oneDNN on a weight packed once (layers/cpu_packed.py)
  q4 / q8:    torch's int4 (groups of 32) / int8 (per row) packed matmuls on bf16 activations (layers/cpu_quant.py;
              q4 is the fallback where the native kernel does not build)
  vnni:       oneDNN int8 x int8 (AVX512-VNNI) on int8 weights, each row's activations quantized to int8 first
  native:     blockspec's own Q4 x Q8 kernel (blockspec/native/q4gemm.c) on the q4 codes, fp32 activations
              quantized to int8 per block of 32 inside (what q4 runs where the kernel builds)
Usage: python -m benchmarks.cpu_quant_kernels [--threads 1,2] [--kinds f32,bf16,q4,q8,vnni,native]"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from blockspec.layers import cpu_quant
from blockspec.layers.cpu_packed import PackedLinear

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
ROWS = (1, 4, 5, 16)
Linear = Callable[[torch.Tensor], torch.Tensor]


def vnni(w: torch.Tensor) -> Linear:
    codes, scale = cpu_quant.int8_quantize(w)
    packed = torch.ops.onednn.qlinear_prepack(codes, None)
    w_scale, w_zero = scale.float(), torch.zeros(w.shape[0], dtype=torch.long)

    def f(x: torch.Tensor) -> torch.Tensor:
        s = x.abs().amax(-1, keepdim=True) / 127
        xq = torch.round(x / s).add_(128).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, packed, w_scale, w_zero, None, 1.0, 0, torch.float32,
                                                  "none", [], "") * s
    return f


KINDS: dict[str, Callable[[torch.Tensor], Linear]] = {
    "f32": lambda w: PackedLinear(w, None, torch.float32, 16),
    "bf16": lambda w: PackedLinear(w, None, torch.bfloat16, 16),
    "q4": lambda w: cpu_quant.Int4Linear(w, None),
    "q8": lambda w: cpu_quant.quantize("q8", w, None),
    "vnni": vnni,
    "native": lambda w: cpu_quant.NativeQ4Linear(w, None),
}


def median_ms(fn: Callable[[], object], n: int = 7) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(*s, generator=g) * 0.02 for s in LAYER] for _ in range(30)]
    head_w = torch.randn(*HEAD, generator=g) * 0.02
    for t in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(t)
        for kind in args.kinds.split(","):
            make = KINDS[kind]
            layers = [[make(w) for w in layer] for layer in weights]
            head = make(head_w)
            for M in ROWS:
                xs = [torch.randn(M, s[1], generator=g) for s in LAYER]
                xh = torch.randn(M, HEAD[1], generator=g)
                lt = median_ms(lambda: [f(x) for layer in layers for f, x in zip(layer, xs)])
                ht = median_ms(lambda: head(xh))
                print(f"threads {t} {kind:5s} rows {M:2d}: layers {lt:6.2f} ms, head {ht:5.2f} ms, "
                      f"total {lt + ht:6.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
