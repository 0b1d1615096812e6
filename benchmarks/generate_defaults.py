"""`blockspec generate --prompt P --chat` with and without `--draft` and no other flag, as a new user runs it: one
process per prompt (the demo's prompts), the two alternating, tokens/s as `generate --json` reports it (the
decoding alone: load and the first run's calibration stay out), tau, and whether the outputs are equal
(docs/performance.md).
The draft length calibration is measured once before the timed runs (its cache is what a user's second run reads).
--sets humaneval,mtbench,gsm8k --per-set 20: the first prompts of those evaluation sets (first turns) instead of the
demo's, none of which any default was tuned on, with each set's median speedup, the slowest prompt's and the
overall median of the per-prompt ratios (issue 54's acceptance). --threads N: torch's threads in both (default: all).
Usage:
  python -m benchmarks.generate_defaults [--max-tokens 128] [--draft DIR] [--sets A,B --per-set N] [--threads N]
      [--out FILE] [-- GENERATE FLAGS]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from blockspec.demo import DEMO_PROMPTS
from blockspec.loading.bundled_draft import bundled_draft_path


def generate(prompt: str, flags: list[str], threads: int | None = None) -> tuple[dict, str]:
    """generate --json's object for one prompt, and its stderr (threads: torch's, through OMP_NUM_THREADS)."""
    cmd = [sys.executable, "-m", "blockspec", "generate", "--prompt", prompt, "--chat", "--json", *flags]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", default=None, help="DFlash drafter (default: the bundled one)")
    ap.add_argument("--sets", default=None, help="evaluation sets, e.g. humaneval,mtbench,gsm8k (default: the demo's "
                                                  "prompts)")
    ap.add_argument("--per-set", type=int, default=20, help="the first N prompts of each set")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("flags", nargs="*", help="after --: flags for both runs (e.g. --cpu-quant auto)")
    args = ap.parse_args(argv)
    args.draft = args.draft or str(bundled_draft_path())  # resolved only when not given
    common = ["--max-tokens", str(args.max_tokens), *args.flags]
    if args.sets:
        from blockspec.data.eval_prompts import load_eval_prompts

        prompts = [(name, text) for name in args.sets.split(",") for text in load_eval_prompts(name, args.per_set)]
    else:
        prompts = [("demo", text) for text in DEMO_PROMPTS]
    t0 = time.perf_counter()
    _, err = generate(DEMO_PROMPTS[0], [*common, "--draft", args.draft], args.threads)  # calibrates, or reads the cache
    calibration = next((line for line in err.splitlines() if line.startswith("draft length schedule")), None)
    print(f"{calibration} [first run {time.perf_counter() - t0:.1f}s]", flush=True)
    rows = []
    for i, (name, prompt) in enumerate(prompts):
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        runs = {mode: generate(prompt, common if mode == "plain" else [*common, "--draft", args.draft], args.threads)[0]
                for mode in order}
        plain, spec = runs["plain"], runs["spec"]
        rows.append({"set": name, "prompt": prompt[:120], "plain_tok_s": plain["tokens_per_second"],
                     "spec_tok_s": spec["tokens_per_second"], "tau": spec.get("mean_acceptance_length") or 1.0,
                     "tokens": len(plain["token_ids"]), "same": plain["token_ids"] == spec["token_ids"],
                     "schedule": spec.get("draft_len_schedule"), "used": spec.get("draft_lens_used")})
        rows[-1]["speedup"] = round(rows[-1]["spec_tok_s"] / rows[-1]["plain_tok_s"], 3)
        print(json.dumps(rows[-1]), flush=True)
    plain_s = sum(r["tokens"] / r["plain_tok_s"] for r in rows)
    spec_s = sum(r["tokens"] / r["spec_tok_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    sets = {name: round(statistics.median(r["speedup"] for r in rows if r["set"] == name), 3)
            for name in dict.fromkeys(r["set"] for r in rows)}
    result = {"plain_tok_s": round(tokens / plain_s, 2), "spec_tok_s": round(tokens / spec_s, 2),
              "speedup": round(plain_s / spec_s, 3),
              "median_speedup": round(statistics.median(r["speedup"] for r in rows), 3),
              "set_median_speedup": sets, "slowest_prompt_speedup": min(r["speedup"] for r in rows),
              "tau": round(statistics.mean(r["tau"] for r in rows), 2), "differ": sum(not r["same"] for r in rows),
              "calibration": calibration, "max_tokens": args.max_tokens, "threads": args.threads,
              "flags": args.flags,
              "command": "python -m benchmarks.generate_defaults " + " ".join(argv if argv is not None else
              sys.argv[1:]),
              "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
