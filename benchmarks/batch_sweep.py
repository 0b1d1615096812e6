"""`blockspec bench` at several batch sizes, one row each: does speculation pay at every batch size with the default
draft length schedule? Each batch size runs in its own process (a fresh GPU pool and compile cache, so one batch's
state cannot favour the next). Rows {batch, tau, spec_tps, plain_tps, speedup, speedup_range, outputs_identical,
kernel compiles inside timed runs, draft length schedule} into --out. Usage (the bundled pair by default):
  python -m benchmarks.batch_sweep [--model M --draft D] [--batches 1,8,32,64] [--prompts humaneval]
      [--max-tokens 256] [--repeats 3] --out docs/results/data/batch-sweep-DEVICE-DATE.json
A batch of B decodes max(16, 2B) prompts of the set (at most all of them), so every batch size runs full waves."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def bench_row(base: list[str], batch: int, num_prompts: int) -> dict:
    cmd = [*base, "--max-batch-size", str(batch), "--num-prompts", str(num_prompts), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"batch {batch}: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    spec, plain = r["spec"], r["plain"]
    return {"batch": batch, "num_prompts": num_prompts, "tau": spec["mean_acceptance_length"],
            "spec_tps": spec["tokens_per_second"], "plain_tps": plain["tokens_per_second"], "speedup": r["speedup"],
            "speedup_range": r["speedup_range"], "outputs_identical": r["outputs_identical"],
            "kernel_compiles_in_timed_runs": sum(len(c) for m in (spec, plain) for c in m["runs_kernel_compiles"]),
            "draft_len": spec.get("draft_len_schedule"), "order": r["timing"]["order"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="default: the bundled drafter")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--set-size", type=int, default=164, help="prompts in --prompts (the largest --num-prompts)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from blockspec.loading.bundled_draft import bundled_draft_path

    draft = args.draft or str(bundled_draft_path())
    base = [sys.executable, "-m", "blockspec", "bench", "--draft", draft, "--prompts", args.prompts,
            "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    if args.model:
        base += ["--model", args.model]
    rows = []
    for batch in map(int, args.batches.split(",")):
        rows.append(bench_row(base, batch, min(args.set_size, max(16, 2 * batch))))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python -m benchmarks.batch_sweep", *(argv or sys.argv[1:])]),
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
