"""`blockspec eval-draft`: a drafter's acceptance and speedup on a shipped evaluation set, plus an acceptance PNG."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from blockspec.cli.bench import add_timing_args
from blockspec.cli.flags import (add_device_args, add_max_batch_size, add_max_tokens, add_model_arg, add_sampling_args,
                                 add_speculative_args, add_speed_args, load_config, report_plan, speculative_config)
from blockspec.data.eval_prompts import EVAL_SETS


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    add_speculative_args(p, skip=["probabilistic_drafting"], draft_model={
        "help": "DFlash drafter, or a draft model with --speculative-method draft-model (default with the bundled "
                "target and no --speculative-method ngram: the bundled drafter)"})
    p.add_argument("--dataset", required=True, choices=EVAL_SETS)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (default: all)")
    add_max_tokens(p, 256, "new tokens per prompt")
    add_sampling_args(p, filters=False, seed=0, seed_help="sampling seed of prompt i is seed + i (temperature > 0)")
    add_speed_args(p)
    add_max_batch_size(p, None, "requests decoded together (default: 1 on CPU, single-stream speed; 8 on CUDA)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_timing_args(p)
    add_device_args(p)
    p.add_argument("--out-dir", default="eval-draft", help="where the PNG and the JSON report go")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (the last stdout line)")


def _differing(rows: list[dict] | None) -> str:
    if not rows:
        return ""
    firsts = ", ".join(str(d["first_divergence"]) for d in rows[:8]) + (", ..." if len(rows) > 8 else "")
    return f" ({len(rows)} prompts differ, first at tokens {firsts})"


def _rounding_hint(r: dict) -> str:
    """Greedy outputs that differ on the GPU without --batch-invariant: verify and decode rows rounded apart."""
    if r["outputs_identical"] is False and r.get("device") == "cuda" and not r.get("batch_invariant"):
        return "\n  (verify rows and plain decode rows round differently here; --batch-invariant makes them equal)"
    return ""


def _draft_options(r: dict) -> str:
    quant = r.get("cpu_quant", "off")
    opts = (["packed CPU target"] if r.get("cpu_packed") else []) + (
        [f"{quant} CPU target"] if quant != "off" else []) + (
        ["batch-invariant target"] if r.get("batch_invariant") else []) + (
        ["bf16 CPU drafter"] if r.get("cpu_bf16_draft") else []) + (
        [f"draft vocab {r['draft_vocab_size']}"] if r.get("draft_vocab_size") is not None else [])
    return f" ({', '.join(opts)})" if opts else ""


def _timing(r: dict) -> str:
    """How the speedup was timed: the runs' order, and over several runs each the range and the spreads."""
    order = " ".join("no-spec" if m == "plain" else m for m in r["timing_order"])
    missed = sum(len(c) for c in (r["runs_kernel_compiles"] or []) + (r["baseline_runs_kernel_compiles"] or []))
    warn = f"; {missed} Triton compiles inside the timed runs: speeds understated" if missed else ""
    if len(r["timing_order"]) <= 2:
        return f" (one run each, warmed up: {order}{warn})"
    lo, hi = r["speedup_range"]
    return (f" (medians of {len(r['runs_time_s'])} runs each, warmed up: {order}; range {lo:.2f}-{hi:.2f}x, "
            f"spread spec {r['time_spread']:.0%} / no-spec {r['baseline_time_spread']:.0%}{warn})")


def _table(r: dict) -> str:
    tau = r["mean_acceptance_length"]
    per_pos = "  ".join(f"{i}:{a:.2f}" for i, a in enumerate(r["per_position_acceptance"], 1))
    return "\n".join([
        f"eval-draft {r['dataset']}: {r['num_prompts']} prompts, max {r['max_tokens']} new tokens, "
        f"temperature {r['temperature']}, {'' if r['method'] == 'dflash' else r['method'] + ', '}"
        f"K={r['num_draft_tokens']}"
        f"{' (full-block drafting)' if r.get('full_block_drafting') else ''}{_draft_options(r)}, "
        f"batch {r['max_batch_size']}",
        f"{'':24s}{'spec':>12s}{'no-spec':>12s}",
        f"{'generated tokens':24s}{r['generated_tokens']:12d}{r['baseline_generated_tokens']:12d}",
        f"{'time (s)':24s}{r['time_s']:12.2f}{r['baseline_time_s']:12.2f}",
        f"{'tokens/s':24s}{r['tokens_per_second']:12.1f}{r['baseline_tokens_per_second']:12.1f}",
        f"speedup: {r['speedup']:.2f}x" + _timing(r),
        f"tau (mean acceptance length): {tau:.2f} over {r['num_verify_steps']} verify steps" if tau is not None
        else "tau: no verify steps",
        f"per-position acceptance: {per_pos}",
        f"outputs identical to no-spec: {r['outputs_identical']}" + _differing(r.get("differing_outputs"))
        + _rounding_hint(r),
        f"acceptance plot: {r['png']}   report: {r['report']}",
    ])


def run(args: argparse.Namespace) -> int:
    from blockspec.data.eval_prompts import load_eval_prompts
    from blockspec.data.prompts import encode_prompts
    from blockspec.errors import BlockspecError
    from blockspec.evaluation.eval_draft import evaluate_draft
    from blockspec.evaluation.plot import write_acceptance_png
    from blockspec.loading.bundled_draft import bundled_draft_path
    from blockspec.loading.loader import load_model
    from blockspec.sampling import SamplingParams
    from blockspec.speculative.registry import load_proposer, method_of

    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise BlockspecError(f"--max-batch-size must be >= 1, got {args.max_num_seqs}")
    ngram = args.method == "ngram"  # prompt lookup: no drafter, none bundled to default to
    if args.draft_model is None and args.model is not None and not ngram:
        raise BlockspecError("--model needs --draft (the bundled drafter is for the bundled target only)")
    spec = speculative_config(args, draft=None if ngram else args.draft_model or str(bundled_draft_path()))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    texts = load_eval_prompts(args.dataset, args.limit)
    lm = load_model(args.model, load_config(args))
    proposer = load_proposer(spec, lm)
    prompts = encode_prompts(lm, texts, chat=not args.no_chat)
    report_plan(lm.plan.with_proposer(proposer))
    on_gpu = next(lm.model.parameters()).device.type == "cuda"
    batch = args.max_num_seqs or (8 if on_gpu else 1)
    report = evaluate_draft(lm, proposer, prompts, params, args.dataset, max_num_seqs=batch, repeats=args.repeats,
                            first=args.first)
    out_dir = Path(args.out_dir)
    png = write_acceptance_png(report, out_dir / f"{args.dataset}-acceptance.png",
                               f"{args.dataset}: {Path(spec.draft_model or proposer.name).name} on "
                               f"{lm.source.name}")
    result = {**asdict(report), "model": lm.source.name, "method": method_of(spec), "draft": spec.draft_model,
              "max_tokens": args.max_tokens,
              "temperature": args.temperature, "chat_template": not args.no_chat,
              "full_block_drafting": args.full_block_drafting, "cpu_bf16_draft": args.cpu_bf16_draft,
              "cpu_packed": args.cpu_packed, "cpu_quant": lm.cpu_quant, "batch_invariant": args.batch_invariant,
              "draft_vocab_size": args.draft_vocab_size,
              "max_batch_size": batch, "device": "cuda" if on_gpu else "cpu", "png": str(png),
              "report": str(out_dir / f"{args.dataset}-report.json")}
    Path(result["report"]).write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else _table(result))
    return 0
