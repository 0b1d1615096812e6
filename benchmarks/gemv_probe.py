"""Probe (issue 26, item 1): can a Triton GEMV read a decode step's weights faster than cuBLAS does at batch 1?
For each Qwen3-8B-shaped projection, the GB/s of F.linear and of a row-blocked Triton GEMV (a grid of configs),
against the copy bandwidth. Prints one JSON object; nothing in the engine uses this kernel yet.
Usage: python -m benchmarks.gemv_probe [--out FILE]"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Callable

import torch
import triton
import triton.language as tl

# (name, N out, K in) of the target's matrices at batch 1 (the lm_head once)
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
          ("lm_head", 151936, 4096)]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program: BLOCK_N output rows, the whole K, fp32 accumulation; rows of W are contiguous in K
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                    other=0.0)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, warps: int, stages: int) -> torch.Tensor:
    """x [K], w [N, K] -> [N]."""
    N, K = w.shape
    y = torch.empty(N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, N, K, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                             num_stages=stages)
    return y


def time_us(fn, iters: int = 50) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    # a cold L2 for every call: flush by touching a buffer larger than the cache
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[iters // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cuda"
    a = torch.empty(1 << 30, dtype=torch.int8, device=dev)
    b = torch.empty_like(a)
    copy_gbps = 2 * a.numel() / time_us(lambda: b.copy_(a), 20) / 1e3
    del a, b
    report: dict = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbps, "shapes": []}
    configs = list(itertools.product((16, 32, 64), (256, 512), (4, 8), (3,)))
    for name, N, K in SHAPES:
        w = torch.randn(N, K, dtype=torch.bfloat16, device=dev)
        x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
        ref = torch.nn.functional.linear(x, w)[0]
        nbytes = w.numel() * 2
        cublas_us = time_us(lambda: torch.nn.functional.linear(x, w))
        row = {"name": name, "N": N, "K": K, "cublas_GBps": nbytes / cublas_us / 1e3}
        best = None
        for bn, bk, warps, stages in configs:
            try:
                y = gemv(x[0], w, bn, bk, warps, stages)
                err = (y.float() - ref.float()).abs().max().item()
                gbps = nbytes / time_us(lambda: gemv(x[0], w, bn, bk, warps, stages), 20) / 1e3
            except Exception as e:  # noqa: BLE001 - a config out of resources is skipped
                continue
            # bf16 outputs of K-long dot products round at ~2^-8 of their size: a relative bound, not an absolute one
            if err <= 2e-2 * ref.float().abs().max().item() and (best is None or gbps > best["GBps"]):
                best = {"GBps": gbps, "block_n": bn, "block_k": bk, "warps": warps, "stages": stages, "max_err": err}
        row["triton_best"] = best
        report["shapes"].append(row)
        print(json.dumps(row), flush=True)
        del w
    total = sum(N * K * 2 for _, N, K in SHAPES[:4]) * 36 + SHAPES[4][1] * SHAPES[4][2] * 2
    def step_ms(gbps: Callable[[dict], float]) -> float:
        return sum(N * K * 2 * (1 if n == "lm_head" else 36) / gbps(r) / 1e6
                   for (n, N, K), r in zip(SHAPES, report["shapes"]))

    # "faster_of_each": cuBLAS where no Triton config was correct and faster, as a per-shape dispatch would run
    report["step_gemm_ms"] = {
        "cublas": step_ms(lambda r: r["cublas_GBps"]),
        "faster_of_each": step_ms(lambda r: max(r["cublas_GBps"], (r["triton_best"] or {"GBps": 0.0})["GBps"])),
        "floor_at_copy_bw": total / copy_gbps / 1e6}
    print(json.dumps(report["step_gemm_ms"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
