"""Where a speculative CPU step's time goes, beside a plain step's (issue 54): the bundled pair loaded as `blockspec
generate --draft <bundled drafter>` loads it (the platform plan's CPU defaults), one target for both, the demo's
prompts decoded plainly and with DFlash at a fixed K, a clock around each part of the step (benchmarks/
cpu_step_profile.timed_parts): the target's layer stack (the verify rows), its head, the drafter's context append, its
block pass and its head, and the engine (the rest of the wall time: scheduling, sampling, acceptance, Python). Prints
ms per step of each part for both and the ratio of the whole steps.
Usage: python -m benchmarks.spec_step_cost [--threads 2] [--k 3] [--prompts 4] [--max-tokens 96] [--cpu-quant M]
    [--no-full-block] [--draft-len-schedule off] [--rounds 5] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from benchmarks.cpu_step_profile import timed_parts
from blockspec.cli.flags import parse_schedule
from blockspec.config import EngineConfig
from blockspec.demo import DEMO_PROMPTS
from blockspec.llm import LLM, load_models
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.loading.load_config import LoadConfig
from blockspec.sampling import SamplingParams

ROWS = [("target stack (verify rows)", "target stack"), ("target head", "  head"),
        ("draft context append", "draft context append"), ("drafter stack (block rows)", "  native drafter stack"),
        ("draft head", "  draft head (argmax)"), ("draft pass, the rest", "draft rest"), ("engine", "engine")]


def step_parts(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """ms per decode step of each part over `prompts` (one at a time, after a warm-up), the whole step, and tokens
    per step. Greedy decoding at a fixed K takes the same steps every time: an untimed decode counts them."""
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)
    totals: dict[str, float] = {}
    steps = tokens = 0
    wall = 0.0
    for ids in prompts:
        rec = llm.generate([ids], params, use_tqdm=False)[0]
        steps += len(rec.acceptance_lengths) if llm.engine.proposer is not None else len(rec.token_ids) - 1
        tokens += len(rec.token_ids)
        # the decode steps alone: the same request cut after its first token (the prefill, and with a drafter its
        # first draft pass) is timed too and taken off
        w, parts = timed_parts(llm, ids, params)
        w1, parts1 = timed_parts(llm, ids, replace(params, max_tokens=1))
        wall += w - w1
        for k in parts.keys() | parts1.keys():
            totals[k] = totals.get(k, 0.0) + parts.get(k, 0.0) - parts1.get(k, 0.0)
    ms = {k: v / steps * 1e3 for k, v in totals.items()}
    ms["step"] = wall / steps * 1e3
    ms["target stack"] = ms.get("target forward", 0.0) - ms.get("  head", 0.0)
    ms["draft rest"] = (ms.get("draft pass (propose)", 0.0) - ms.get("  native drafter stack", 0.0)
                        - ms.get("  draft head (argmax)", 0.0))
    ms["engine"] = ms["step"] - ms.get("target forward", 0.0) - ms.get("draft pass (propose)", 0.0) - ms.get(
        "draft context append", 0.0)
    ms["tokens per step"] = (tokens - len(prompts)) / steps  # the first token of each came from the prefill
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="the first N demo prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cpu-quant", default=None, help="the target's CPU path (default: the platform's, auto for the "
                                                      "bundled Q4_1 model)")
    ap.add_argument("--draft-len-schedule", default="off",
                    help="the spec engine's (default off: K throughout; 1:0 times a K = 0 step with the drafter)")
    ap.add_argument("--no-full-block", action="store_true", help="draft K + 1 rows, not the drafter's block size")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved plain / spec rounds (medians are printed)")
    ap.add_argument("--out", help="write the figures as JSON here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = LoadConfig(device="cpu") if args.cpu_quant is None else LoadConfig(device="cpu", cpu_quant=args.cpu_quant)
    speculative = {"draft_model": str(bundled_draft_path()), "num_draft_tokens": args.k}
    if args.no_full_block:
        speculative["full_block_drafting"] = False
    models = load_models(None, load, speculative)
    tok = models.lm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in DEMO_PROMPTS[: args.prompts]]
    params = SamplingParams(max_tokens=args.max_tokens)
    plain = LLM.from_loaded(models.lm, None, engine=EngineConfig(max_num_seqs=1))
    schedule = parse_schedule(args.draft_len_schedule)
    spec = LLM.from_loaded(models.lm, models.draft, engine=EngineConfig(max_num_seqs=1, draft_len_schedule=schedule))
    t0 = time.perf_counter()
    rounds: dict[str, list[dict[str, float]]] = {"plain": [], "spec": []}
    for _ in range(args.rounds):  # interleaved: this VM's speed drifts by tens of % between minutes
        rounds["plain"].append(step_parts(plain, prompts, params))
        rounds["spec"].append(step_parts(spec, prompts, params))
    # each part's median over the rounds, and the whole step's ratio per round (its median is what is quoted)
    figures = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in rounds.items()}
    ratios = [s_["step"] / p_["step"] for p_, s_ in zip(rounds["plain"], rounds["spec"])]
    p, s = figures["plain"], figures["spec"]
    print(f"{models.plan.target} target, {args.threads} thread(s), K = {args.k}, {args.prompts} demo prompts x "
          f"{args.max_tokens} tokens, medians of {args.rounds} interleaved rounds ({time.perf_counter() - t0:.0f} s)")
    print(f"  {'ms per step':28s} {'plain':>7s} {'K = ' + str(args.k):>7s}")
    for label, key in ROWS:
        print(f"  {label:28s} {p.get(key, 0.0):7.2f} {s.get(key, 0.0):7.2f}")
    print(f"  {'whole step':28s} {p['step']:7.2f} {s['step']:7.2f}   ratio {statistics.median(ratios):.2f}x "
          f"(median of {args.rounds} rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  {'tokens per step':28s} {p['tokens per step']:7.2f} {s['tokens per step']:7.2f}   decode speedup "
          f"{s['tokens per step'] / s['step'] / (p['tokens per step'] / p['step']):.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "K": args.k, "prompts": args.prompts, "max_tokens": args.max_tokens,
                       "target": models.plan.target, "ms_per_step": figures,
                       "ratio": statistics.median(ratios), "ratios": ratios, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
