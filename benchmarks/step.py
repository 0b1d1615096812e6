"""Step benchmark on the GPU, in one run: the engine's own decode step (`engine.decode_step_bench`, replayed from
its CUDA graph) for plain AR decoding and for DFlash spec decoding (verify B x (K+1) + accept + context append + next
drafts), on a Qwen3-8B-shaped bf16 target with random weights and a 5-layer block-16 drafter, against
  - the floor: the bytes a step must read (benchmarks/parts.py, FLOOR_DEFINITION: the matrices it multiplies, the
    embedding rows it gathers, the K/V it attends; per batch and context) / copy bandwidth measured in the same run;
  - HF transformers `generate` on identical weights (batch 1);
plus a per-part breakdown (GEMMs / attention / other kernels / gaps), end-to-end tokens/s through LLMEngine with a
forced acceptance length (benchmark-only), and a bf16 greedy comparison with HF (first divergences and their
top-2 logit gaps). Usage: python -m benchmarks.step --out docs/results/data/step-bench-DEVICE-DATE.json
(--batch-invariant: only the step table, as usual and then with the target batch-invariant, for that mode's cost;
--recompute-floor FILE...: the floor fields of recorded runs, from their own step times and copy bandwidth)"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from benchmarks.parts import apply_floor, with_floor
from benchmarks.random_pair import make_pair
from benchmarks.stage_times import observe
from blockspec.config import EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.step_bench import DecodeStepBench
from blockspec.loading.dflash_options import ResolvedSpec
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel, instantiate
from blockspec.models.config import ModelConfig
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import ForcedAcceptance
from blockspec.speculative.schedule import derive_schedule

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False)
MASK, TAPS, DRAFT_LAYERS = 151669, [1, 9, 17, 25, 33], 5


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


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    return 2 * nbytes / (time_ms(lambda: b.copy_(a), 20) / 1e3)  # read + write


def free_memory() -> None:
    """A dropped engine may sit in reference cycles with its CUDA graph pool: collect it before the next pool."""
    gc.collect()
    torch.cuda.empty_cache()


def decode_step(lm: LoadedModel, draft: LoadedDraft | None, B: int, ctx: int, K: int
                ) -> tuple[LLMEngine, DecodeStepBench]:
    """An engine for B requests and its decode step on B random tokens each at context ctx, verifying K drafts,
    every request's blocks laid out in turn (LLMEngine.decode_step_bench)."""
    per = -(-(ctx + 2 * K + 2) // 16)  # 16: EngineConfig's default KV block size
    engine = LLMEngine(lm, draft, EngineConfig(max_num_seqs=B, num_kv_blocks=B * per))
    return engine, engine.decode_step_bench(B, K, ctx)


def step_ms(lm: LoadedModel, draft: LoadedDraft | None, B: int, ctx: int, K: int | None = None,
            eager: bool = True) -> tuple[float, float | None, dict | None]:
    """(graph ms, eager ms, breakdown at batch 1) of one decode step of B requests at context ctx, with K drafts
    (default: the drafter's)."""
    from benchmarks.parts import breakdown

    if K is None:
        K = draft.spec.num_draft_tokens if draft is not None else 0
    engine, step = decode_step(lm, draft, B, ctx, K)
    with torch.inference_mode():
        step.graph()  # warm-up + capture
        graph = time_ms(step.graph, 30)
        if not eager:
            return graph, None, None
        eager_ms = time_ms(step.eager, 10)
        parts = breakdown(step.eager, graph) if B == 1 and ctx == 1024 else None
    return graph, eager_ms, parts  # the engine and its pool are freed on return


def forced_schedule(lm: LoadedModel, draft: LoadedDraft, batches: tuple[int, ...], ctx: int, tau: float,
                    ks: tuple[int, ...] = (0, 3, 5, 6, 7, 11, 15)) -> dict:
    """The draft length schedule the rule of blockspec/speculative/schedule.py derives for this pair on this GPU
    when every block accepts as ForcedAcceptance(tau) does (p_i = 1 up to tau - 1, then the fraction, then 0), from
    each K's measured step cost per batch: the "default schedule" of the end-to-end runs."""
    K = draft.spec.num_draft_tokens
    want = tau - 1.0
    per_position = [min(max(want - i, 0.0), 1.0) for i in range(K)]
    costs = {}
    for B in batches:
        costs[B] = {k: step_ms(lm, draft, B, ctx, K=k, eager=False)[0] / 1e3 for k in ks if k <= K}
        free_memory()
    schedule = derive_schedule(costs, per_position)
    return {"schedule": schedule, "costs_ms": {B: {k: c * 1e3 for k, c in by_k.items()} for B, by_k in costs.items()},
            "per_position": per_position, "context": ctx}


def end_to_end(lm: LoadedModel, draft: LoadedDraft | None, B: int, ctx: int, new: int, tau: float | None,
               overlap: bool = True, schedule: dict[int, int] | None = None) -> dict:
    """tokens/s of LLMEngine.generate: B requests, ctx-token random prompts, `new` tokens each (prefill included);
    and the GPU's idle time between consecutive decode-step replays (the host gap), median over the run."""
    from blockspec.llm import LLM

    forced = ForcedAcceptance(tau) if tau is not None else None
    llm = LLM.from_loaded(lm, draft, acceptance=forced,
                          engine=EngineConfig(max_num_seqs=B, kv_cache_tokens=B * (ctx + new + 64), overlap=overlap,
                                              draft_len_schedule=schedule))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, lm.config.vocab_size, (ctx,), generator=g).tolist() for _ in range(2 * B)]
    warm, prompts = prompts[:B], prompts[B:]
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    # capture graphs (this batch's bucket) and compile the prefill kernels on B prompts of the same length that are
    # NOT timed: reusing a timed prompt would make its prefill a prefix-cache hit of another shape (a Triton compile
    # inside the timing)
    llm.generate(warm, SamplingParams(max_tokens=48, ignore_eos=True), use_tqdm=False)
    host = observe(llm.engine, gaps=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    gaps = host.host_gaps_ms()
    n = sum(len(o.token_ids) for o in outs)
    acc = [a for o in outs for a in o.acceptance_lengths]
    return {"batch": B, "context": ctx, "new_tokens": new, "forced_tau": tau, "overlap": overlap,
            "draft_len_schedule": schedule, "tokens": n,
            "time_s": dt, "tokens_per_second": n / dt, "measured_tau": sum(acc) / len(acc) if acc else None,
            "decode_replays": len(host.marks), "host_gap_ms_median": statistics.median(gaps) if gaps else None,
            "host_breakdown_s": {k: round(v, 4) for k, v in host.totals.items()}}


def greedy_vs_hf(lm: LoadedModel, draft: LoadedDraft, hf, n_prompts: int = 8, n: int = 64) -> dict:
    from benchmarks.hf_ref import hf_greedy
    from blockspec.llm import LLM

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, lm.config.vocab_size, (32,), generator=g).tolist() for _ in range(n_prompts)]
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    engine = EngineConfig(max_num_seqs=8)
    plain = [o.token_ids for o in LLM.from_loaded(lm, None, engine=engine).generate(prompts, params, use_tqdm=False)]
    spec = [o.token_ids for o in LLM.from_loaded(lm, draft, engine=engine).generate(prompts, params, use_tqdm=False)]
    rows = []
    for i, p in enumerate(prompts):
        ref, gaps = hf_greedy(hf, p, n)
        first = next((j for j, (a, b) in enumerate(zip(plain[i], ref)) if a != b), None)
        rows.append({"prompt": i, "equal_to_hf": plain[i] == ref, "first_divergence": first,
                     "hf_top2_gap_at_divergence": gaps[first] if first is not None else None,
                     "min_hf_top2_gap": min(gaps), "spec_equal_to_plain": spec[i] == plain[i]})
    return {"prompts": n_prompts, "tokens": n, "rows": rows,
            "all_equal_to_hf": all(r["equal_to_hf"] for r in rows),
            "all_spec_equal_to_plain": all(r["spec_equal_to_plain"] for r in rows)}


def meta_pair(K: int) -> tuple[LoadedModel, LoadedDraft]:
    """The benchmark's target and drafter on the meta device: their shapes and dtypes without memory, for the floor
    of a recorded run (make_pair draws random weights, which the meta device cannot)."""
    meta, cfg = torch.device("meta"), ModelConfig.from_hf({**QWEN3_8B, "dtype": "bfloat16"})
    dcfg = DFlashConfig.from_hf({**QWEN3_8B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": DRAFT_LAYERS,
                                 "block_size": 16, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TAPS}},
                                "bench")
    with meta:
        draft = DFlashDraftModel(dcfg, num_taps=len(TAPS)).to(torch.bfloat16)
    lm = LoadedModel(instantiate(cfg, meta, torch.bfloat16), cfg, None, [], None)  # type: ignore[arg-type]
    return lm, LoadedDraft(draft, dcfg, ResolvedSpec(K, MASK, TAPS, 16, False))


def recompute_floor(path: str) -> None:
    """Rewrite a recorded run's floor fields from its own step times and copy bandwidth (the floor as run is kept
    under `floor_as_run`)."""
    with open(path) as f:
        report = json.load(f)
    K = report["table"][0]["K"]
    lm, draft = meta_pair(K)
    as_run = report.get("floor_as_run") or {
        "definition": "all target parameters (the input embedding table included); spec: + drafter + lm_head again; "
                      "no K/V",
        "floor_ms_bs1": report["floor_ms_bs1"], "spec_floor_ms_bs1": report["spec_floor_ms_bs1"]}
    if "copy_bandwidth_GBps" in report:
        bw = report["copy_bandwidth_GBps"] * 1e9
    else:  # the old floor was all target parameters over the bandwidth
        bw = sum(p.numel() * p.element_size() for p in lm.model.parameters()) / (as_run["floor_ms_bs1"] / 1e3)
    out = apply_floor({**report, "floor_as_run": as_run}, lm, draft, bw)
    out["floor_recomputed"] = "recomputed from the run's step times and copy bandwidth with the corrected floor"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="step_bench.json")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--K", type=int, default=15)
    ap.add_argument("--forced-tau", type=float, default=6.5, help="benchmark-only acceptance for end-to-end tok/s")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="only the step table, first as usual, then with the target batch-invariant "
                         "(layers/invariant_linear.py): what that mode costs, from one run")
    ap.add_argument("--recompute-floor", nargs="+", metavar="JSON", help="no GPU run: rewrite the floor fields of "
                    "these recorded runs from their step times and copy bandwidth")
    args = ap.parse_args()
    if args.recompute_floor:
        for path in args.recompute_floor:
            recompute_floor(path)
        return
    bw = copy_bandwidth()
    lm, draft = make_pair(QWEN3_8B, args.K, DRAFT_LAYERS, TAPS, MASK, torch.device("cuda"), torch.bfloat16)
    t_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    d_bytes = sum(p.numel() * p.element_size() for p in draft.model.parameters())

    def table(lm: LoadedModel) -> tuple[list[dict], dict]:
        rows, parts = [], {}
        for ctx in map(int, args.contexts.split(",")):
            for B in map(int, args.batches.split(",")):
                ar, ar_eager, ar_parts = step_ms(lm, None, B, ctx)
                free_memory()
                spec, spec_eager, spec_parts = step_ms(lm, draft, B, ctx)
                free_memory()
                if ar_parts:
                    parts = {"ar": ar_parts, "spec": spec_parts}
                r = with_floor({"batch": B, "context": ctx, "K": args.K, "ar_step_ms": ar, "spec_step_ms": spec,
                                "ar_eager_ms": ar_eager, "spec_eager_ms": spec_eager, "spec_over_ar": spec / ar,
                                "batch_invariant": lm.batch_invariant}, lm, draft, bw)
                rows.append(r)
                print(json.dumps(r), flush=True)
        print(json.dumps(parts, indent=1), flush=True)
        return rows, parts

    rows, parts = table(lm)
    base = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9,
            "target_weight_bytes": t_bytes, "draft_weight_bytes": d_bytes}
    if args.batch_invariant:
        from dataclasses import replace

        from blockspec.layers.invariant_linear import make_batch_invariant

        make_batch_invariant(lm.model)
        inv_rows, inv_parts = table(replace(lm, plan=replace(lm.plan, batch_invariant=True)))
        with open(args.out, "w") as f:
            json.dump(apply_floor({**base, "table": rows, "table_batch_invariant": inv_rows,
                                   "breakdown_bs1_ctx1k": parts, "breakdown_bs1_ctx1k_batch_invariant": inv_parts},
                                  lm, draft, bw), f, indent=1)
        return
    free_memory()
    try:
        sched = forced_schedule(lm, draft, (1, 32), 1024, args.forced_tau)
    except Exception as e:  # noqa: BLE001 - the end-to-end figures still come, with K = 15 throughout
        sched = {"schedule": None, "error": f"{type(e).__name__}: {e}"}
        free_memory()
    print(json.dumps(sched), flush=True)
    s = sched["schedule"]
    e2e = [end_to_end(lm, draft, B, 1024, 512, args.forced_tau, schedule=s) for B in (1, 32)]
    e2e += [end_to_end(lm, None, B, 1024, 512, None) for B in (1, 32)]
    e2e.append(end_to_end(lm, draft, 1, 1024, 512, args.forced_tau, overlap=False, schedule=s))
    e2e.append(end_to_end(lm, draft, 32, 1024, 512, args.forced_tau))  # K = 15 at every batch, for comparison
    for r in e2e:
        print(json.dumps(r), flush=True)
    (spec1, spec32, plain1, plain32, sync1, spec32_k) = e2e
    e2e_keys = {"e2e_spec_tps_bs1": spec1["tokens_per_second"], "e2e_plain_tps_bs1": plain1["tokens_per_second"],
                "e2e_speedup_c32": spec32["tokens_per_second"] / plain32["tokens_per_second"],
                "e2e_speedup_c32_fixed_k": spec32_k["tokens_per_second"] / plain32["tokens_per_second"],
                "e2e_draft_len_schedule": sched,
                "overlap_host_gap_ms_bs1": spec1["host_gap_ms_median"],
                "no_overlap_host_gap_ms_bs1": sync1["host_gap_ms_median"]}
    from benchmarks.hf_ref import hf_ar_step_ms, hf_twin

    free_memory()

    hf = hf_twin(QWEN3_8B, lm.model)
    hf_ms = hf_ar_step_ms(hf)
    greedy = greedy_vs_hf(lm, draft, hf)
    print(json.dumps(greedy), flush=True)
    bs1 = next(r for r in rows if r["batch"] == 1 and r["context"] == 1024)
    report = apply_floor({
        **base, **e2e_keys, "ar_step_ms_bs1": bs1["ar_step_ms"], "spec_step_ms_bs1": bs1["spec_step_ms"],
        "hf_ar_step_ms_bs1": hf_ms, "ar_speedup_vs_hf_bs1": hf_ms / bs1["ar_step_ms"], "breakdown_bs1_ctx1k": parts,
        "end_to_end": e2e, "greedy_vs_hf_bf16": greedy, "table": rows}, lm, draft, bw)
    print(json.dumps({k: v for k, v in report.items() if k not in ("table", "end_to_end", "greedy_vs_hf_bf16")},
    indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
