"""Step micro-benchmark on the GPU: AR decode step and DFlash spec step (verify + accept + context append + draft)
of a Qwen3-8B-shaped bf16 target with random weights, each captured in one CUDA graph, against the weight-read
floor (bytes / measured copy bandwidth) and against HF transformers `generate` on identical weights.

The step here is the models' GPU work with fixed metadata (what the engine's captured step replays), not the
engine's host bookkeeping. Usage: python -m blockspec.bench.step --out step_bench.json"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blockspec.attention.backends import TritonDraftAttention, TritonTargetAttention
from blockspec.attention.paged_ref import PagedBatch
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.loading.loader import instantiate
from blockspec.models.config import ModelConfig
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig
from blockspec.spec.verify import accept_tokens

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, dtype="bfloat16")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = time_ms(lambda: b.copy_(a), 20)
    return 2 * nbytes / (ms / 1e3)  # read + write


def time_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def graph_ms(fn, iters: int = 30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_ms(g.replay, iters)


def make_models():
    cfg = ModelConfig.from_hf(QWEN3_8B)
    target = instantiate(cfg, torch.device("cuda"), torch.bfloat16)
    dcfg = DFlashConfig.from_hf({**QWEN3_8B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 5,
                                 "block_size": 16, "dflash_config": {"mask_token_id": 151669,
                                                                     "target_layer_ids": [1, 9, 17, 25, 33]}}, "bench")
    with torch.device("cuda"):
        draft = DFlashDraftModel(dcfg, num_taps=5).to(torch.bfloat16)
    for m in (target, draft):
        for p in m.parameters():
            p.data.normal_(0, 0.02)
    return cfg, target, dcfg, draft


def batch_for(B: int, ctx: int, rows: int, pool: KVPool, write: bool) -> PagedBatch:
    bs = pool.block_size
    per = pool.num_blocks // B
    tables = torch.arange(B * per, device="cuda").view(B, per)
    pos = torch.arange(ctx, ctx + rows, device="cuda").repeat(B)
    slots = (tables[torch.arange(B, device="cuda").repeat_interleave(rows), pos // bs] * bs + pos % bs) if write \
        else torch.full_like(pos, -1)
    return PagedBatch(pos, slots, [i * rows for i in range(B + 1)], [ctx + rows if write else ctx] * B, tables)


def step_times(cfg, target, dcfg, draft, B: int, ctx: int, K: int = 15) -> dict:
    bs = 16
    per = -(-(ctx + K + 3) // bs)
    pool = KVPool(B * per, bs, CacheShape(36, 8, 128), CacheShape(5, 8, 128), torch.bfloat16, torch.device("cuda"))
    taps = [1, 9, 17, 25, 33]
    with torch.inference_mode():
        ar = batch_for(B, ctx, 1, pool, True)
        ar_attn = TritonTargetAttention(pool, ar)
        ar_ids = torch.randint(0, cfg.vocab_size, (B,), device="cuda")

        def ar_step():
            return target(ar_ids, ar.positions, ar_attn).logits.argmax(-1)

        ver = batch_for(B, ctx, K + 1, pool, True)
        ver_attn = TritonTargetAttention(pool, ver)
        ver_ids = torch.randint(0, cfg.vocab_size, (B * (K + 1),), device="cuda")
        blk = batch_for(B, ctx + 1, K + 1, pool, False)
        blk_attn = TritonDraftAttention(pool, blk)
        blk_ids = torch.full((B * (K + 1),), 151669, device="cuda")

        def spec_step():
            out = target(ver_ids, ver.positions, ver_attn, tap_layers=taps)
            toks = out.logits.argmax(-1).view(B, K + 1)
            emitted, n = accept_tokens(ver_ids.view(B, K + 1)[:, 1:], toks)
            # context append for committed rows (slots of rejected rows masked to -1), then the next draft block
            keep = torch.arange(K + 1, device="cuda")[None, :] <= n[:, None]
            slots = torch.where(keep.flatten(), ver.slot_mapping, torch.full_like(ver.slot_mapping, -1))
            from blockspec.attention.triton_paged import store_kv
            for layer, (k, v) in enumerate(draft.context_kv(out.taps, ver.positions)):
                store_kv(k, v, pool.draft_k[layer], pool.draft_v[layer], slots)
            ids = blk_ids.view(B, K + 1).clone()
            ids[:, 0] = emitted.gather(1, n[:, None])[:, 0]
            hidden = draft(target.embed_tokens(ids.flatten()), blk.positions, blk_attn)
            rows = hidden.view(B, K + 1, -1)[:, 1:].reshape(B * K, -1)
            return draft.compute_logits(rows, target.lm_head).argmax(-1)

        ar_ms, spec_ms = graph_ms(ar_step), graph_ms(spec_step)
        ar_eager = time_ms(ar_step, 10)
    del pool
    torch.cuda.empty_cache()
    return {"batch": B, "context": ctx, "K": K, "ar_step_ms": ar_ms, "spec_step_ms": spec_ms, "ar_eager_ms": ar_eager,
            "spec_over_ar": spec_ms / ar_ms}


def hf_ar_ms(target_cfg: dict, target) -> float:
    import transformers as tf

    cfg = tf.Qwen3Config(**{k: v for k, v in target_cfg.items() if k not in ("architectures", "dtype")})
    with torch.device("meta"):
        hf = tf.Qwen3ForCausalLM(cfg)
    hf = hf.to_empty(device="cuda").to(torch.bfloat16).eval()
    sd = {}
    for i, layer in enumerate(target.layers):  # identical weights: unpack our fused projections
        q, k, v = layer.self_attn.qkv_proj.weight.split([4096, 1024, 1024])
        g, u = layer.mlp.gate_up_proj.weight.chunk(2)
        pre = f"model.layers.{i}."
        sd.update({pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k, pre + "self_attn.v_proj.weight": v,
                   pre + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight, pre + "self_attn.q_norm.weight": layer.self_attn.q_norm.weight,
                   pre + "self_attn.k_norm.weight": layer.self_attn.k_norm.weight, pre + "mlp.gate_proj.weight": g, pre + "mlp.up_proj.weight": u,
                   pre + "mlp.down_proj.weight": layer.mlp.down_proj.weight, pre + "input_layernorm.weight": layer.input_layernorm.weight,
                   pre + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    sd.update({"model.embed_tokens.weight": target.embed_tokens.weight, "model.norm.weight": target.norm.weight,
               "lm_head.weight": target.lm_head.weight})
    hf.load_state_dict(sd, strict=False)
    hf.model.rotary_emb.to("cuda")
    ids = torch.randint(0, 151936, (1, 1024), device="cuda")
    n = 32
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    del hf
    torch.cuda.empty_cache()
    return ((t1 - t0) - (t2 - t1)) / (n - 1) * 1e3  # per decode step, prefill subtracted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="step_bench.json")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="1024,8192")
    args = ap.parse_args()
    bw = copy_bandwidth()
    cfg, target, dcfg, draft = make_models()
    t_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    d_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
    head = target.lm_head.weight.numel() * 2
    floor_ms, spec_floor_ms = t_bytes / bw * 1e3, (t_bytes + d_bytes + head) / bw * 1e3
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        for B in map(int, args.batches.split(",")):
            r = step_times(cfg, target, dcfg, draft, B, ctx)
            rows.append(r)
            print(json.dumps(r), flush=True)
    try:
        hf_ms = hf_ar_ms(QWEN3_8B, target)
    except Exception as e:  # keep the engine figures even if the HF side breaks
        print(f"HF transformers timing failed: {type(e).__name__}: {e}", flush=True)
        hf_ms = float("nan")
    bs1 = next(r for r in rows if r["batch"] == 1 and r["context"] == 1024)
    report = {
        "device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "target_weight_bytes": t_bytes,
        "draft_weight_bytes": d_bytes, "floor_ms_bs1": floor_ms, "spec_floor_ms_bs1": spec_floor_ms,
        "ar_step_ms_bs1": bs1["ar_step_ms"], "spec_step_ms_bs1": bs1["spec_step_ms"], "hf_ar_step_ms_bs1": hf_ms,
        "ar_ratio_to_floor_bs1": bs1["ar_step_ms"] / floor_ms, "spec_ratio_to_floor_bs1": bs1["spec_step_ms"] / spec_floor_ms,
        "ar_speedup_vs_hf_bs1": hf_ms / bs1["ar_step_ms"], "table": rows,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "table"}, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
