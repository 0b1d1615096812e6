"""The batch-invariant GEMM's tile against cuBLAS on the GPU, from one run: for each candidate tile, the time of every
linear of a Qwen3-8B-shaped and a SmolLM2-135M-shaped target at M = 1, 16, 256 and 2048 rows (decode, verify of 16
requests x 16 rows, prefill), its ratio to F.linear, and a check that rows do not depend on M. The tile with the
lowest geometric-mean ratio over the decode and verify shapes (M <= 256) is printed last (the candidate for
layers/invariant_linear.TILE). Usage: python -m benchmarks.invariant_gemm [--out FILE]"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from blockspec.layers.invariant_linear import Tile, invariant_linear

# (name, N, K) of each linear: packed qkv, o, packed gate_up, down, lm_head
SHAPES = {
    "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
                 ("lm_head", 151936, 4096)],
    "smollm2-135m": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                     ("lm_head", 49152, 576)],
}
ROWS = (1, 16, 256, 2048)
TILES = ["64,64,64,4,3", "64,32,128,4,4", "64,128,64,4,3", "64,64,128,4,3", "16,64,128,4,4", "16,32,256,4,3",
         "32,32,128,4,4", "128,64,64,8,3"]


def time_us(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="invariant_gemm.json")
    ap.add_argument("--tiles", default=";".join(TILES), help="candidate tiles, ';'-separated 'bm,bn,bk,warps,stages'")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, score, broken = [], {}, set()
    for model, shapes in SHAPES.items():
        for name, N, K in shapes:
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            x = torch.randn(max(ROWS), K, device="cuda", dtype=torch.bfloat16, generator=gen)
            for tile_text in args.tiles.split(";"):
                tile = Tile.parse(tile_text)
                full = invariant_linear(x, w, tile=tile)
                for M in ROWS:
                    invariant = torch.equal(invariant_linear(x[:M], w, tile=tile), full[:M])
                    ours = time_us(lambda: invariant_linear(x[:M], w, tile=tile))
                    ref = time_us(lambda: F.linear(x[:M], w))
                    r = {"model": model, "linear": name, "N": N, "K": K, "M": M, "tile": tile_text, "us": ours,
                         "cublas_us": ref, "ratio": ours / ref, "rows_invariant": invariant,
                         "weight_GBps": N * K * 2 / ours / 1e3}
                    rows.append(r)
                    if not invariant:
                        broken.add(tile_text)
                    if M <= 256:
                        score.setdefault(tile_text, []).append(math.log(ours / ref))
    geo = {t: math.exp(sum(v) / len(v)) for t, v in score.items()}
    best = min((t for t in geo if t not in broken), key=geo.get)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "geomean_ratio_m_le_256": geo,
                   "not_invariant": sorted(broken), "best": best, "rows": rows}, f, indent=1)
    for t in geo:  # the tile's ratio to cuBLAS per linear of the 8B shape at M = 1 / 16 / 256 / 2048
        per = {name: [round(x["ratio"], 2) for x in rows
                      if x["tile"] == t and x["model"] == "qwen3-8b" and x["linear"] == name]
               for name, _, _ in SHAPES["qwen3-8b"]}
        print(t, f"geomean {geo[t]:.2f}", "NOT INVARIANT" if t in broken else "", json.dumps(per), flush=True)
    print(best)


if __name__ == "__main__":
    main()
