"""fla-core's gated-delta-rule kernels on this GPU, the questions the hybrid engine's design rests on (issue 52):
1. fused_recurrent / chunk vs a torch reference of the recurrence (fp32);
2. rollback by masked replay: the K + 1 verify rows replayed from the old state with log-decay g := 0 and beta := 0
   on the rows after the accepted ones leave a state bitwise equal to decoding the accepted rows one at a time
   (exp(0) = 1 and a zero-beta update change nothing), so a verify needs no per-row state copies;
3. varlen rows of one sequence independent of the other sequences in the call (batch invariance);
4. CUDA-graph capture with the initial state gathered from state slots and scattered back;
5. microseconds per eager call at Qwen3.5-9B's linear-attention shape (16 k heads, 32 v heads, 128 x 128 fp32 state),
   Python wrapper included (a captured step pays only the kernel).
Needs fla-core (`pip install fla-core==0.6.0`; carried as a wheel to the device machine) and einops.
Usage: python -m benchmarks.gated_delta_probe [--out FILE.json]"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

H, HV, DK, DV = 16, 32, 128, 128  # Qwen3.5-9B's linear attention: k heads, v heads, head dims
SCALE = DK ** -0.5
DEV = "cuda"


def reference(q, k, v, g, beta, h0):
    """The recurrence row by row in fp32: h <- h * exp(g); h += k (beta (v - k h)); o = (q * scale) h.
    q, k [B, T, HV, DK] (k heads repeated to the v heads), v [B, T, HV, DV], g / beta [B, T, HV], h0 [B, HV, DK, DV]."""
    h = h0.clone().float()
    o = torch.empty(*q.shape[:3], v.shape[-1], device=q.device)
    for t in range(q.shape[1]):
        h = h * g[:, t].float().exp()[..., None, None]
        kt = k[:, t].float()
        pred = torch.einsum("bhk,bhkv->bhv", kt, h)
        h = h + torch.einsum("bhk,bhv->bhkv", kt, (v[:, t].float() - pred) * beta[:, t].float()[..., None])
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t].float() * SCALE, h)
    return o, h


def inputs(B: int, T: int, dtype: torch.dtype):
    q = F.normalize(torch.randn(B, T, H, DK, device=DEV), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, DK, device=DEV), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, DV, device=DEV).to(dtype)
    g = -F.softplus(torch.randn(B, T, HV, device=DEV)).float()
    beta = torch.sigmoid(torch.randn(B, T, HV, device=DEV)).to(dtype)
    h0 = torch.randn(B, HV, DK, DV, device=DEV) * 0.1
    return q, k, v, g, beta, h0


def run(fn, q, k, v, g, beta, h0, **kw):
    return fn(q, k, v, g=g, beta=beta, scale=SCALE, initial_state=h0, output_final_state=True, **kw)


def against_reference(fn, T: int) -> dict:
    q, k, v, g, beta, h0 = inputs(2, T, torch.float32)
    o, ht = run(fn, q, k, v, g, beta, h0)
    rep = lambda x: x.repeat_interleave(HV // H, dim=2)  # noqa: E731
    o_r, h_r = reference(rep(q), rep(k), v, g, beta, h0)
    return {"rows": T, "o_maxdiff": (o - o_r).abs().max().item(), "h_maxdiff": (ht - h_r).abs().max().item()}


def masked_replay(fn, dtype: torch.dtype, T: int = 16) -> list[dict]:
    q, k, v, g, beta, h0 = inputs(1, T, dtype)
    res = []
    for kept in (1, 5, T):
        gm, bm = g.clone(), beta.clone()
        gm[:, kept:] = 0
        bm[:, kept:] = 0
        _, replayed = run(fn, q, k, v, gm, bm, h0)
        h = h0.clone()
        for t in range(kept):
            _, h = run(fn, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], h)
        res.append({"rows_kept": kept, "replay_vs_steps_maxdiff": (replayed - h).abs().max().item(),
                    "bitwise": bool(torch.equal(replayed, h))})
    return res


def varlen_invariance(fn) -> dict:
    q, k, v, g, beta, _ = inputs(1, 48, torch.bfloat16)
    h0s = torch.randn(3, HV, DK, DV, device=DEV) * 0.1
    cu = torch.tensor([0, 16, 32, 48], device=DEV, dtype=torch.long)
    o_all, h_all = run(fn, q, k, v, g, beta, h0s, cu_seqlens=cu)
    mid = slice(16, 32)
    o_1, h_1 = run(fn, q[:, mid], k[:, mid], v[:, mid], g[:, mid], beta[:, mid], h0s[1:2])
    return {"o": bool(torch.equal(o_all[:, mid], o_1)), "h": bool(torch.equal(h_all[1:2], h_1))}


def capture(fn) -> str:
    q, k, v, g, beta, _ = inputs(8, 16, torch.bfloat16)
    slots = torch.randn(64, HV, DK, DV, device=DEV) * 0.1
    idx = torch.arange(8, device=DEV) * 3

    def step():
        o, ht = run(fn, q, k, v, g, beta, slots.index_select(0, idx))
        slots.index_copy_(0, idx, ht)
        return o

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # the answer is the point of the probe
        return f"failed: {type(e).__name__}: {e}"[:500]


def time_us(fn: Callable[[], object], n: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule as recurrent

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "fused_recurrent_vs_ref_fp32": against_reference(recurrent, 16),
           "chunk_vs_ref_fp32": against_reference(chunk_gated_delta_rule, 200),
           "masked_replay_fp32": masked_replay(recurrent, torch.float32),
           "masked_replay_bf16": masked_replay(recurrent, torch.bfloat16),
           "varlen_batch_invariant": varlen_invariance(recurrent),
           "graph_capture": capture(recurrent), "eager_us_per_call": {}}
    for B in (1, 8, 32):
        for T in (1, 16):
            q, k, v, g, beta, h0 = inputs(B, T, torch.bfloat16)
            out["eager_us_per_call"][f"B{B}_T{T}"] = round(time_us(lambda: run(recurrent, q, k, v, g, beta, h0)), 1)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
