"""Two checkouts of blockspec side by side on the CPU: `blockspec generate`'s decode rate (its --json
tokens_per_second: the decode loop alone, load and calibration outside it) for plain and DFlash decoding, fp32 and
`--cpu-quant auto`, the two trees interleaved run by run (the order flips every round), so a refactor that claims
"no behaviour change" can show its step costs did not move. The machine's noise is the spread of a tree's own runs:
compare medians against it. Usage:

    git worktree add /tmp/base <commit>
    python -m benchmarks.tree_ab --base /tmp/base [--new .] [--rounds 3] [--max-tokens 96] [--out FILE.json]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPTS = ["Write a haiku about the sea", "Explain what a hash table is.", "List three uses of Python."]
DRAFT = Path(__file__).resolve().parents[1] / "blockspec" / "drafters" / "smollm2-135m-dflash-b16"
MODES = {"plain": [], "dflash_k3": ["--draft", str(DRAFT), "--num-draft-tokens", "3", "--draft-len-schedule", "off"]}
QUANT = {"fp32": "off", "q4": "auto"}


def rate(tree: str, prompt: str, extra: list[str], max_tokens: int) -> float | None:
    """tokens_per_second of one `generate --json` run with `tree` first on the import path (None: it failed)."""
    cmd = [sys.executable, "-m", "blockspec.cli", "generate", "--prompt", prompt, "--chat", "--json",
           "--max-tokens", str(max_tokens), "--device", "cpu", *extra]
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")
    if out.returncode:
        print(f"{tree}: {' '.join(extra)}: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_second"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = {"base": str(Path(args.base).resolve()), "new": str(Path(args.new).resolve())}
    samples: dict[str, list[float]] = {f"{t}/{m}/{q}": [] for t in trees for m in MODES for q in QUANT}
    for r in range(args.rounds):
        for m, extra in MODES.items():
            for q, flag in QUANT.items():
                for t in ("base", "new") if r % 2 == 0 else ("new", "base"):
                    for p in PROMPTS:
                        tok_s = rate(trees[t], p, [*extra, "--cpu-quant", flag], args.max_tokens)
                        if tok_s is not None:
                            samples[f"{t}/{m}/{q}"].append(tok_s)
    medians = {k: statistics.median(v) for k, v in samples.items() if v}
    rows = []
    for m in MODES:
        for q in QUANT:
            b, n = medians.get(f"base/{m}/{q}"), medians.get(f"new/{m}/{q}")
            if b and n:
                rows.append({"mode": m, "weights": q, "base_tok_s": b, "new_tok_s": n, "new_over_base": n / b})
                print(f"{m:10s} {q:5s} base {b:7.1f} tok/s  new {n:7.1f} tok/s  new/base {n / b:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trees": trees, "rounds": args.rounds, "max_tokens": args.max_tokens, "table": rows,
                       "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
