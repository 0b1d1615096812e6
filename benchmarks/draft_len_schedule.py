"""The draft length schedule of a target + DFlash drafter on this device (blockspec/speculative/schedule.py): what a
decode step costs per (batch size, K), what each draft position is worth on an evaluation set, the K per batch size
that emits the most tokens per second, and with --install that table in the drafter's directory (the engine's
default schedule on this device from then on). Usage (the bundled pair by default):
  python -m benchmarks.draft_len_schedule [--model M --draft D] [--dataset humaneval --limit 32]
      [--batches 1,2,4,8,16,32,64] [--ks 0,1,2,3,5,7,11,15] [--context 512] [--out FILE] [--install]

Cost of a step: B requests with random prompts of --context tokens decode with K drafts (a schedule of K at every
batch size) and no draft accepted (ForcedAcceptance(1), benchmark only: every step verifies K + 1 rows per request
and emits one token each), after a warm-up on other prompts; runs of --steps and of 2 x --steps new tokens (the
faster of two each), and the cost is their time difference per extra step, which leaves prefill out. Worth of a position: greedy decoding of the
dataset's prompts (chat template, --max-tokens) with K = the largest of --ks, p_i = the share of verify steps whose
i-th draft was accepted."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.data.eval_prompts import load_eval_prompts
from blockspec.data.prompts import encode_prompts
from blockspec.engine.calibrate import measure_acceptance
from blockspec.llm import LLM
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import ForcedAcceptance
from blockspec.speculative.schedule import derive_schedule, device_key, expected_tokens, install_schedule


def per_position_acceptance(lm: LoadedModel, draft: LoadedDraft, prompts: list[list[int]], max_tokens: int,
                            K: int) -> list[float]:
    """p_1..p_K over every verify step of greedy decoding of `prompts` with K drafts (the engine's calibration)."""
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=min(16, len(prompts)), draft_len_schedule={1: K}))
    return measure_acceptance(llm.engine, prompts, max_tokens)


def step_seconds(lm: LoadedModel, draft: LoadedDraft, batch: int, K: int, context: int, steps: int) -> float:
    """Seconds per decode step of `batch` requests with K drafts each (prefill differenced out)."""
    vocab = lm.config.vocab_size
    llm = LLM.from_loaded(lm, draft, acceptance=ForcedAcceptance(1.0),
                          engine=EngineConfig(max_num_seqs=batch, draft_len_schedule={1: K},
                                              kv_cache_tokens=batch * (context + 2 * steps + 2 * K + 64)))
    g = torch.Generator().manual_seed(batch * 100 + K)

    def prompts() -> list[list[int]]:  # fresh ones each run: no prefix-cache hit shortens a prefill
        return [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    run(steps)  # warm-up: graphs captured, kernels chosen
    # the fastest of two runs of each length: a pause in one run must not make the difference (or its sign) noise
    return (min(run(2 * steps), run(2 * steps)) - min(run(steps), run(steps))) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=None, help="DFlash drafter directory (default: the bundled drafter)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=32, help="prompts of the dataset for the per-position acceptance")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--ks", default="0,1,2,3,5,7,11,15")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here too")
    ap.add_argument("--install", action="store_true", help="record the table in the drafter's directory")
    args = ap.parse_args(argv)
    batches, ks = [int(b) for b in args.batches.split(",")], sorted({int(k) for k in args.ks.split(",")})
    lm = load_model(args.model, LoadConfig(device=args.device, dtype=args.dtype))
    draft_dir = Path(args.draft) if args.draft else bundled_draft_path()
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=max(ks)), lm)
    device = next(lm.model.parameters()).device
    prompts = encode_prompts(lm, load_eval_prompts(args.dataset, args.limit), chat=True)
    per_position = per_position_acceptance(lm, draft, prompts, args.max_tokens, max(ks))
    print("per-position acceptance: " + " ".join(f"{p:.2f}" for p in per_position), flush=True)
    costs: dict[int, dict[int, float]] = {}
    for batch in batches:
        costs[batch] = {k: step_seconds(lm, draft, batch, k, args.context, args.steps) for k in ks}
        rates = {k: batch * expected_tokens(per_position, k) / s for k, s in costs[batch].items()}
        print(f"batch {batch:3d}: " + "  ".join(f"K={k} {s * 1e3:.2f} ms {rates[k]:.0f} tok/s"
                                                for k, s in costs[batch].items()), flush=True)
    schedule = derive_schedule(costs, per_position)
    print("schedule (batch: K): " + ", ".join(f"{b}: {k}" for b, k in schedule.items()))
    table = {"schedule": {str(b): k for b, k in schedule.items()},
             "per_position_acceptance": [round(p, 4) for p in per_position],
             "step_ms": {str(b): {str(k): round(s * 1e3, 3) for k, s in by_k.items()} for b, by_k in costs.items()},
             "device": device_key(device), "model": lm.source.name, "dataset": args.dataset, "prompts": len(prompts),
             "context": args.context, "date": time.strftime("%Y-%m-%d %H:%M"),
             "command": "python -m benchmarks.draft_len_schedule " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.out is not None:
        args.out.write_text(json.dumps(table, indent=1) + "\n")
    if args.install:
        print(f"installed in {install_schedule(draft_dir, device, table)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
