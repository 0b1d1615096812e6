"""The proposer results table of issue 25 (docs/results/data/proposers-h100-qwen2.5-coder-1.5b-2026-12-07.json,
docs/performance.md): for one target, each dataset x
method (none, ngram, draft-model, dflash) x batch, tau and tokens/s against plain decoding, resumable.

Each speculative row is one `evaluate_draft` call (blockspec/evaluation/eval_draft.py, what `blockspec eval-draft`
runs): plain and speculative engines warmed up on stand-ins, timed alternately (plain, spec, spec, plain, ...),
medians. The `none` row is `bench` without a drafter (evaluation/throughput.py, the same warm-up and plain runs), on
evaluate_draft's engine sizing with K = 0 (eval_engine). Greedy, chat template, `--max-tokens` new tokens.

The baseline is measured per row, not shared by the rows of a (dataset, batch): the protocol cancels drift (clocks,
other tenants; docs/results/2026-12-04-bundled-drafter-acceptance.md saw short runs vary +-30 % between calls) by
alternating a row's plain runs with its own
spec runs, and a resumed table is filled over several device calls, often on different machines, so a shared baseline
could come from another call or machine than the row it divides. The price: plain runs repeated for every method.

The target is loaded once per invocation (not at all when no row is pending), each drafter once, on its first row.
Rows are keyed by (target, dataset, method, batch, prompts): a key already in --out is skipped, and --out is
rewritten (temporary file, then rename) after every row, so a killed call loses at most the row it was timing.
--time-budget S: before each row, stop cleanly when the time since main() started (imports not counted) plus the
row's estimate would pass S. The estimate: the wall time per prompt of a done row of the same target, method and
batch (else the slowest of that target and batch), x 1.25; a row with no estimate yet runs. A row cannot be split:
one that alone outlasts a device call (likely gsm8k's 1,319 prompts at batch 1) needs --limit or fewer --repeats. Usage:
  python tools/proposer_table.py --target Q.gguf --target-name NAME --dflash-draft DIR --draft-model SMALL.gguf \\
      --batch-invariant --time-budget 540 [--limit N] [--out
      docs/results/data/proposers-h100-qwen2.5-coder-1.5b-2026-12-07.json]"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from blockspec.config import DEFAULT_NGRAM_DRAFT_TOKENS, DEFAULT_NGRAM_MAX, SpeculativeConfig
from blockspec.data.eval_prompts import load_eval_prompts
from blockspec.data.prompts import encode_prompts
from blockspec.errors import BlockspecError
from blockspec.evaluation.eval_draft import eval_engine, evaluate_draft
from blockspec.evaluation.throughput import bench
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.proposer import Proposer
from blockspec.speculative.registry import load_proposer

DATASETS = ("humaneval", "mbpp", "gsm8k", "math500", "mtbench")  # the issue's order
METHODS = ("none", "ngram", "draft-model", "dflash")
# K where --num-draft-tokens does not set it: eval-draft's (ngram: DEFAULT_NGRAM_DRAFT_TOKENS; dflash: None, the
# drafter's block_size - 1); eval-draft has none for draft-model, so the README's example, 4
DEFAULT_K: dict[str, int | None] = {"ngram": DEFAULT_NGRAM_DRAFT_TOKENS, "draft-model": 4, "dflash": None}
KEY = ("target", "dataset", "method", "batch", "prompts")
SAFETY = 1.25  # on a row's time estimate: datasets differ in prompt and answer lengths


def parse_names(flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise BlockspecError(f"{flag}: unknown name {bad[0]!r} (choose from {', '.join(allowed)})" if bad else
                             f"{flag}: empty list (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(names))


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise BlockspecError(f"--batches: expected integers >= 1 separated by commas, got {text!r}")
    return list(dict.fromkeys(batches))


def parse_k(text: str | None) -> dict[str, int | None]:
    """"ngram=5,draft-model=4" over DEFAULT_K."""
    ks = dict(DEFAULT_K)
    for item in (text or "").split(","):
        if not item.strip():
            continue
        method, _, k = item.partition("=")
        if method.strip() not in DEFAULT_K or not k.strip().isdigit() or int(k) < 1:
            raise BlockspecError(f"--num-draft-tokens: expected METHOD=K with METHOD one of {', '.join(DEFAULT_K)} "
                                 f"and K >= 1, got {item!r}")
        ks[method.strip()] = int(k)
    return ks


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="proposer_table.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target: a .gguf file or an HF directory")
    p.add_argument("--target-name", default=None, help="the rows' `target` (default: the --target file name)")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batches", default="1,16")
    p.add_argument("--dflash-draft", default=None, help="DFlash drafter directory (method dflash)")
    p.add_argument("--draft-model", default=None, help="small causal LM with the target's tokenizer (draft-model)")
    p.add_argument("--num-draft-tokens", default=None, metavar="METHOD=K,...",
                   help=f"K per method (default: ngram {DEFAULT_K['ngram']}, draft-model {DEFAULT_K['draft-model']}, "
                        f"dflash the drafter's block_size - 1)")
    p.add_argument("--ngram-max", type=int, default=DEFAULT_NGRAM_MAX)
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of each dataset (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per mode and row (default 2)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS")
    p.add_argument("--out", type=Path,
                   default=Path("docs/results/data/proposers-h100-qwen2.5-coder-1.5b-2026-12-07.json"))
    args = p.parse_args(argv)
    args.datasets = parse_names("--datasets", args.datasets, DATASETS)
    args.methods = parse_names("--methods", args.methods, METHODS)
    args.batches = parse_batches(args.batches)
    args.ks = parse_k(args.num_draft_tokens)
    if args.repeats < 1:
        raise BlockspecError(f"--repeats must be >= 1, got {args.repeats}")
    if args.ngram_max < 1:
        raise BlockspecError(f"--ngram-max must be >= 1, got {args.ngram_max}")
    for method, flag in (("dflash", "dflash_draft"), ("draft-model", "draft_model")):
        if method in args.methods and getattr(args, flag) is None:
            raise BlockspecError(f"--methods has {method}: pass --{flag.replace('_', '-')} (or drop {method})")
    args.target_name = args.target_name or Path(args.target).name
    return args


def key(row: dict[str, Any]) -> tuple:
    return tuple(row[k] for k in KEY)


def order(row: dict[str, Any]) -> tuple:
    return (row["target"], DATASETS.index(row["dataset"]) if row["dataset"] in DATASETS else len(DATASETS),
            row["dataset"], METHODS.index(row["method"]) if row["method"] in METHODS else len(METHODS),
            row["method"], row["batch"], row["prompts"])


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BlockspecError(f"{path}: not JSON ({e}); move it away or fix it") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and set(KEY) <= set(r) for r in rows):
        raise BlockspecError(f"{path}: expected a list of rows, each with the keys {', '.join(KEY)}")
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """All or nothing: a call killed mid-write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(sorted(rows, key=order), indent=1) + "\n")
    os.replace(tmp, path)


def estimate(rows: list[dict[str, Any]], target: str, method: str, batch: int, prompts: int) -> float | None:
    """Seconds a row should take, from the done rows of `target` that recorded their wall time."""
    timed = [r for r in rows if r.get("wall_s") and (r["target"], r["batch"]) == (target, batch) and r["prompts"]]
    same = [r for r in timed if r["method"] == method] or timed
    return SAFETY * prompts * max(r["wall_s"] / r["prompts"] for r in same) if same else None


def measure(lm: LoadedModel, proposer: Proposer | None, prompts: list[list[int]], params: SamplingParams,
            dataset: str, batch: int, repeats: int) -> dict[str, Any]:
    """One row's figures: evaluate_draft with `proposer`, or (None) bench's plain runs alone."""
    if proposer is None:
        r = bench(lm, None, prompts, params, repeats=repeats, engine=eval_engine(prompts, params.max_tokens, 0, batch))
        plain = r["plain"]
        tps = plain["tokens_per_second"]
        return dict(tau=1.0, tokens_per_second=tps, baseline_tokens_per_second=tps, speedup=1.0,
                    outputs_identical=True,  # the baseline itself: plain decoding
                    num_draft_tokens=0, generated_tokens=plain["generated_tokens"],
                    baseline_generated_tokens=plain["generated_tokens"], timing_order=r["timing"]["order"],
                    baseline_runs_time_s=plain["runs_time_s"], baseline_time_spread=plain["time_spread"])
    rep = evaluate_draft(lm, proposer, prompts, params, dataset, max_num_seqs=batch, use_tqdm=False, repeats=repeats)
    return dict(tau=rep.mean_acceptance_length, tokens_per_second=rep.tokens_per_second,
                baseline_tokens_per_second=rep.baseline_tokens_per_second, speedup=rep.speedup,
                outputs_identical=rep.outputs_identical, num_draft_tokens=rep.num_draft_tokens,
                generated_tokens=rep.generated_tokens, baseline_generated_tokens=rep.baseline_generated_tokens,
                timing_order=rep.timing_order, runs_time_s=rep.runs_time_s,
                baseline_runs_time_s=rep.baseline_runs_time_s, time_spread=rep.time_spread,
                baseline_time_spread=rep.baseline_time_spread, speedup_range=rep.speedup_range,
                differing_outputs=rep.differing_outputs)


def proposer_spec(args: argparse.Namespace, method: str) -> SpeculativeConfig:
    k = args.ks[method]
    if method == "ngram":
        return SpeculativeConfig(method="ngram", ngram_max=args.ngram_max, num_draft_tokens=k)
    draft = args.dflash_draft if method == "dflash" else args.draft_model
    return SpeculativeConfig(draft_model=draft, method=method, num_draft_tokens=k)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| target | dataset | method | batch | prompts | K | tau | tok/s | plain tok/s | speedup | identical |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=order):
        lines.append(f"| {r['target']} | {r['dataset']} | {r['method']} | {r['batch']} | {r['prompts']} | "
                     f"{r.get('num_draft_tokens') or '-'} | {fmt(r.get('tau'), '.2f')} | "
                     f"{fmt(r.get('tokens_per_second'), '.1f')} | {fmt(r.get('baseline_tokens_per_second'), '.1f')} | "
                     f"{fmt(r.get('speedup'), '.2f')}x | {r.get('outputs_identical')} |")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens)  # greedy; raises for a bad --max-tokens
    texts = {d: load_eval_prompts(d, args.limit) for d in args.datasets}
    rows = read_rows(args.out)
    done = {key(r) for r in rows}
    todo = [(d, b, m) for d in args.datasets for b in args.batches for m in args.methods
            if (args.target_name, d, m, b, len(texts[d])) not in done]
    print(f"{len(todo)} rows to measure; {len(args.datasets) * len(args.batches) * len(args.methods) - len(todo)} "
          f"already in {args.out}", flush=True)
    command = shlex.join(["python", "tools/proposer_table.py", *argv])
    lm: LoadedModel | None = None
    proposers: dict[str, Proposer] = {}
    prompts: dict[str, list[list[int]]] = {}
    for i, (dataset, batch, method) in enumerate(todo):
        n = len(texts[dataset])
        elapsed, need = time.monotonic() - start, estimate(rows, args.target_name, method, batch, n)
        if args.time_budget is not None and (elapsed >= args.time_budget or
                                             need is not None and elapsed + need > args.time_budget):
            why = (f"--time-budget {args.time_budget:g} s reached" if elapsed >= args.time_budget else
                   f"the next row ({dataset} {method} batch {batch}) needs ~{need:.0f} s, "
                   f"{args.time_budget - elapsed:.0f} s of --time-budget left")
            print(f"stopped: {why}; {len(todo) - i} rows left (run the same command again to resume)", flush=True)
            break
        if lm is None:
            for flag in ("target", "dflash_draft", "draft_model"):
                path = getattr(args, flag)
                if path is not None and not Path(path).exists():
                    raise BlockspecError(f"--{flag.replace('_', '-')} {path}: no such file or directory")
            lm = load_model(args.target, LoadConfig(device=args.device, dtype=args.dtype,
                                                    batch_invariant=args.batch_invariant))
        if method != "none" and method not in proposers:
            try:
                proposers[method] = load_proposer(proposer_spec(args, method), lm)
            except BlockspecError as e:
                raise BlockspecError(f"{method}: {e}") from None
        if dataset not in prompts:
            prompts[dataset] = encode_prompts(lm, texts[dataset], chat=True)
        t0 = time.monotonic()
        figures = measure(lm, proposers.get(method), prompts[dataset], params, dataset, batch, args.repeats)
        param = next(lm.model.parameters())
        row = {"target": args.target_name, "dataset": dataset, "method": method, "batch": batch, "prompts": n,
               **figures, "command": command, "max_tokens": args.max_tokens, "repeats": args.repeats,
               "ngram_max": args.ngram_max if method == "ngram" else None,
               "draft": {"dflash": args.dflash_draft, "draft-model": args.draft_model}.get(method),
               "device": param.device.type, "dtype": str(param.dtype).removeprefix("torch."),
               "batch_invariant": lm.batch_invariant, "wall_s": round(time.monotonic() - t0, 2)}
        rows.append(row)
        write_rows(args.out, rows)
        print(f"[{i + 1}/{len(todo)}] {args.target_name} {dataset} {method} batch {batch} ({n} prompts): tau "
              f"{fmt(row['tau'], '.2f')}, {row['tokens_per_second']:.1f} vs {row['baseline_tokens_per_second']:.1f} "
              f"tok/s, {row['speedup']:.2f}x, outputs identical {row['outputs_identical']} ({row['wall_s']:.0f} s)",
              flush=True)
    print(markdown(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except BlockspecError as e:
        print(f"proposer_table.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
