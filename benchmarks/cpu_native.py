"""The native CPU kernels on the bundled pair (docs/results/2026-12-06-cpu-native-drafter-amx.md): ms per call, median
of
--reps, of the q4 target's whole layer stack (blockspec/native/decoder.c) at 1, 4 and 16 rows after --context
tokens of one sequence, its int8 head, the native drafter's block forward (draft.c's stack in draft-block mode) and
its context append, at each thread count. What a plain step (1 row), a K = 3 verify (4 rows) and a draft block
(16 rows) cost on this machine. Usage: python -m benchmarks.cpu_native [--threads 1,2] [--context 200]"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from benchmarks.cpu_quant_kernels import median_ms
from blockspec.attention.paged_ref import PagedBatch
from blockspec.config import SpeculativeConfig
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.native import q4

BLOCK = 16


def batch(first: int, rows: int, kv_len: int, stored: bool) -> PagedBatch:
    pos = torch.arange(first, first + rows)
    return PagedBatch(pos, pos.clone() if stored else torch.full_like(pos, -1), torch.tensor([0, rows],
                      dtype=torch.int32), torch.tensor([kv_len], dtype=torch.int32), torch.arange(64)[None], rows)


def bundled_native() -> tuple[LoadedModel, LoadedDraft, KVPool] | None:
    """The bundled q4 target and Q8 drafter on the native kernels, and a pool for a context of up to 1,008 tokens;
    None where the kernels did not build (or BLOCKSPEC_NATIVE=0)."""
    lm = load_model(None, LoadConfig(device="cpu", cpu_quant="auto"))
    draft = load_draft(SpeculativeConfig(draft_model=str(bundled_draft_path()), num_draft_tokens=3,
                                         full_block_drafting=True, draft_vocab_size=24576), lm)
    if lm.model.executor is None or draft.model.executor is None:
        return None
    cfg, dcfg = lm.config, draft.config
    pool = KVPool(64, BLOCK, CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),
                  CacheShape(dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim), torch.float32,
                  torch.device("cpu"))
    return lm, draft, pool


def stack_calls(lm: LoadedModel, draft: LoadedDraft, pool: KVPool, ctx: int) -> dict[str, Callable[[], object]]:
    """The target's layer stack at 1, 4 and 16 rows and the drafter's 16-row block after `ctx` tokens of one
    sequence, each a call to time."""
    stack, native_draft, H = lm.model.executor, draft.model.executor, lm.config.hidden_size
    calls: dict[str, Callable[[], object]] = {}
    for rows in (1, 4, 16):
        b, x = batch(ctx, rows, ctx + rows, stored=True), torch.randn(rows, H)
        cos, sin = lm.model.rotary.cos_sin(b.positions, torch.float32)
        calls[f"target_stack_{rows}"] = lambda b=b, x=x, cos=cos, sin=sin: stack.forward(x, cos, sin, pool, b, [])
    b, x = batch(ctx, BLOCK, ctx, stored=False), torch.randn(BLOCK, H)
    cos, sin = draft.model.rotary.cos_sin(b.positions, torch.float32)
    calls["draft_block_16"] = lambda: native_draft.forward(x, cos, sin, pool, b)
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    loaded = bundled_native()
    if loaded is None:
        print("the native kernels did not build here (or BLOCKSPEC_NATIVE=0): nothing to time")
        return 1
    lm, draft, pool = loaded
    ctx, H = args.context, lm.config.hidden_size
    results = {"path": q4.best_path(), "context": ctx, "rows": {}}
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        row = {name: median_ms(call, args.reps) for name, call in stack_calls(lm, draft, pool, ctx).items()}
        for rows in (1, 4):
            x = torch.randn(rows, H)
            row[f"head_{rows}"] = median_ms(lambda: lm.model.compute_logits(x), args.reps)
        taps = torch.randn(4, len(draft.spec.target_layer_ids) * H)
        tc, ts = draft.model.rotary.cos_sin(torch.arange(ctx, ctx + 4), torch.float32)
        slots = torch.arange(ctx, ctx + 4)
        row["draft_context_4"] = median_ms(lambda: draft.model.executor.context(
            taps, tc, ts, list(pool.draft_k), list(pool.draft_v), slots), args.reps)
        results["rows"][threads] = row
        print(f"{threads} thread(s): " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()), flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
