"""Per-part breakdown of a step's GPU time: kernels profiled in an eager run of the same step, grouped into GEMMs,
attention (our paged attention and KV store kernels) and the rest; what the captured step takes beyond the sum of
its kernels is launch gaps / idle time."""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

_GEMM = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|splitk|matmul", re.I)
_ATTN = re.compile(r"paged_attn|store_kv", re.I)


def breakdown(step: Callable[[], object], graph_ms: float, iters: int = 3) -> dict[str, float]:
    """ms per step by part, from `iters` eager runs (after one warm-up) of `step`."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    parts = {"gemm_ms": 0.0, "attention_ms": 0.0, "other_kernels_ms": 0.0}
    top: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = e.device_time / 1e3 / iters
        key = "gemm_ms" if _GEMM.search(e.name) else "attention_ms" if _ATTN.search(e.name) else "other_kernels_ms"
        parts[key] += ms
        if key == "other_kernels_ms":
            top[e.name[:60]] = top.get(e.name[:60], 0.0) + ms
    parts["kernels_total_ms"] = sum(parts.values())
    parts["graph_step_ms"] = graph_ms
    parts["gaps_ms"] = graph_ms - parts["kernels_total_ms"]
    parts["top_other_kernels"] = dict(sorted(top.items(), key=lambda kv: -kv[1])[:8])
    return parts
