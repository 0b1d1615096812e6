"""Per-part breakdowns of a decode step: its GPU time (kernels profiled in an eager run of the same step, grouped into
GEMMs, attention (our paged attention and KV store kernels) and the rest; what the captured step takes beyond the sum
of its kernels is launch gaps / idle time), and the bytes it must read (the floor the step benchmark divides by)."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel

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


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _kv_row_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    return layers * kv_heads * head_dim * 2 * torch.empty((), dtype=dtype).element_size()


FLOOR_DEFINITION = (
    "bytes one decode step must read: every weight matrix it multiplies, once per multiplication (the target's "
    "layers and final norm, the lm_head once for the verify or decode rows; spec: all the drafter's weights, the k|v "
    "rows of its layers again for the context append, and the draft head for the drafts), the embedding rows it "
    "gathers, and the K/V it attends (target: context + K + 1 keys, drafter: context + 1 keys, per request); not the "
    "embedding table, not the writes. floor ms = bytes / copy bandwidth measured in the same run")


def floor_bytes(lm: LoadedModel, draft: LoadedDraft | None, batch: int, context: int) -> dict[str, int]:
    """Bytes per part of one decode step of `batch` requests at `context` tokens already in the KV, without a
    drafter (plain, K = 0) or with `draft` (K = its num_draft_tokens): FLOOR_DEFINITION."""
    model, cfg = lm.model, lm.config
    head, embed = model.lm_head.weight, model.embed_tokens.weight
    K = draft.spec.num_draft_tokens if draft is not None else 0
    dtype = head.dtype
    parts = {
        "target_matrices": _nbytes(p for p in model.parameters() if p is not head and p is not embed),
        "lm_head": _nbytes([head]),
        "embedding_rows": batch * (K + 1) * cfg.hidden_size * embed.element_size(),  # the verify (or decode) rows
        # the pool's own shape (Gemma 4: layers sharing K/V keep none; Qwen3.5: full-attention layers only)
        "kv": batch * (context + K + 1) * _kv_row_bytes(*dataclasses.astuple(model.kv_cache_shape()), dtype),
    }
    if draft is not None:
        d, dc = draft.model, draft.config
        own_head = _nbytes([*d.greedy_head.parameters(), *d.greedy_head.buffers()])
        # the draft block [bonus, MASK x (rows - 1)] is embedded too
        parts["embedding_rows"] += batch * draft.spec.draft_rows(K) * cfg.hidden_size * embed.element_size()
        parts.update({
            "drafter": _nbytes(d.parameters()),
            # the context append projects the committed rows through each layer's k|v rows: a second read of them
            "drafter_context_kv_rows": _nbytes(layer.self_attn.qkv_proj.kv_rows()[0] for layer in d.layers),
            "draft_lm_head": own_head or _nbytes([head]),  # a smaller draft head (draft vocab) or the target's
            # the draft block attends the committed context (at least context + 1 keys); its own k/v are not stored
            "draft_kv": batch * (context + 1) * _kv_row_bytes(dc.num_hidden_layers, dc.num_key_value_heads,
                                                              dc.head_dim, d.dtype),
        })
    parts["total"] = sum(parts.values())
    return parts


# the parts a GEMM reads (the rest is gathered or attended)
GEMM_PARTS = ("target_matrices", "lm_head", "drafter", "drafter_context_kv_rows", "draft_lm_head")


def floor_ms(parts: dict[str, int], bandwidth: float, names: Iterable[str] | None = None) -> float:
    """ms to read the parts (`names`, default all) at `bandwidth` bytes/s."""
    total = parts["total"] if names is None else sum(parts.get(n, 0) for n in names)
    return total / bandwidth * 1e3


def with_floor(row: dict, lm: LoadedModel, draft: LoadedDraft, bw: float) -> dict:
    """A table row with its floors (FLOOR_DEFINITION, at the row's batch and context) and its step times' ratios."""
    ar, spec = (floor_ms(floor_bytes(lm, d, row["batch"], row["context"]), bw) for d in (None, draft))
    return {**row, "ar_floor_ms": ar, "spec_floor_ms": spec, "ar_ratio_to_floor": row["ar_step_ms"] / ar,
            "spec_ratio_to_floor": row["spec_step_ms"] / spec}


def apply_floor(report: dict, lm: LoadedModel, draft: LoadedDraft, bw: float) -> dict:
    """The report's floor fields, every one computed from its step times and `bw`: `floor_bytes` (per part, batch 1,
    1k context), the batch-1 floors and ratios, each table row's, and the GEMMs' time over the bytes they read."""
    ar, spec = floor_bytes(lm, None, 1, 1024), floor_bytes(lm, draft, 1, 1024)
    out = {**report, "floor_bytes": {"definition": FLOOR_DEFINITION, "batch": 1, "context": 1024, "ar": ar,
                                     "spec": spec},
           "floor_ms_bs1": floor_ms(ar, bw), "spec_floor_ms_bs1": floor_ms(spec, bw)}
    if "ar_step_ms_bs1" in report:
        out["ar_ratio_to_floor_bs1"] = report["ar_step_ms_bs1"] / out["floor_ms_bs1"]
        out["spec_ratio_to_floor_bs1"] = report["spec_step_ms_bs1"] / out["spec_floor_ms_bs1"]
    for key in [k for k in report if k.startswith("table")]:
        out[key] = [with_floor(r, lm, draft, bw) for r in report[key]]
    for key in [k for k in report if k.startswith("breakdown_bs1_ctx1k")]:
        bytes_of = {"ar": ar, "spec": spec}
        out[key] = {mode: {**p, "gemm_floor_ms": floor_ms(bytes_of[mode], bw, GEMM_PARTS),
                           "gemm_ratio_to_floor": p["gemm_ms"] / floor_ms(bytes_of[mode], bw, GEMM_PARTS)}
                    for mode, p in report[key].items()}
    return out
