"""Issue 43's GPU peer benchmark: the bundled pair (SmolLM2-135M-Instruct Q4_1 GGUF and its DFlash drafter) on one GPU
under llama.cpp b11434's CUDA build and under blockspec. Batch 1, greedy, the first --limit prompts of each shipped
eval set with the chat template, --max-tokens new tokens, each prompt one request timed from before its prompt
processing to its last token (as tools/cpu_peer_bench.py times both engines). Rows:
  llama.cpp plain; llama.cpp DFlash (--spec-type draft-dflash, the drafter as `blockspec export-draft --format gguf`
  writes it) at the draft length that was fastest on the first two prompts; blockspec plain; blockspec DFlash with K
  drafts every step, in default bf16 and with --batch-invariant (whose outputs equal its plain decoding).
Each row: tok/s (median of --repeats, rows interleaved), tau, and per prompt whether the engine's DFlash output
equals its own plain output. On the device machine, after tools/setup_gpu_peer.sh, from the repository root:
  python3 tools/gpu_peer_bench.py --bin /tmp/llama-cuda/build/bin/llama-speculative-simple --target FILE.gguf \\
      --draft-gguf /tmp/smollm2-dflash.gguf [--datasets humaneval,mtbench] [--limit 20] --out $OUT/gpu_peers.json"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from blockspec.config import EngineConfig, OFF, SpeculativeConfig
from blockspec.data.eval_prompts import load_eval_prompts
from blockspec.llm import LLM
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
import llama_cpp_peer as peer  # tools/, next to this script
from cpu_peer_bench import first_difference, run_blockspec

OFFLOAD = ["-ngl", "99", "-ngld", "99"]  # every layer of the target and of the drafter on the GPU


def blockspec_engines(target: Path, K: int, device: str) -> dict[str, LLM]:
    """plain, dflash (default bf16) and dflash-bi (--batch-invariant, with its own plain engine), all batch 1 without
    prefix reuse, each warmed up (CUDA graphs captured) on a short request; on the CPU (a smoke run) the first two."""
    engines = {}
    for invariant in (False, True) if device == "cuda" else (False,):
        lm = load_model(str(target), LoadConfig(device=device, batch_invariant=invariant))
        draft = load_draft(SpeculativeConfig(draft_model=str(bundled_draft_path()), num_draft_tokens=K), lm)
        tag = "-bi" if invariant else ""
        engines[f"plain{tag}"] = LLM.from_loaded(lm, None,
                                                 engine=EngineConfig(max_num_seqs=1, enable_prefix_caching=False))
        engines[f"dflash{tag}"] = LLM.from_loaded(lm, draft,
                                                  engine=EngineConfig(max_num_seqs=1, enable_prefix_caching=False,
                                                                      draft_len_schedule=OFF))
    for llm in engines.values():
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
    return engines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True, help="llama-speculative-simple of tools/setup_gpu_peer.sh")
    ap.add_argument("--target", type=Path, required=True, help="the bundled SmolLM2 GGUF, carried in")
    ap.add_argument("--draft-gguf", type=Path, required=True, help="the bundled drafter as llama.cpp reads it")
    ap.add_argument("--datasets", default="humaneval,mtbench")
    ap.add_argument("--limit", type=int, default=20, help="prompts of each set")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-draft-tokens", type=int, default=15, help="blockspec's K (the block's 16 rows - 1)")
    ap.add_argument("--draft-lengths", default="3,7,11,15", help="llama.cpp DFlash draft lengths swept first")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4, help="llama.cpp's CPU threads (sampling, host work)")
    ap.add_argument("--device", default="cuda", help="blockspec's device (cpu: a smoke run of this script only)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    for need in (args.bin, args.target, args.draft_gguf):
        if not need.exists():
            raise SystemExit(f"{need} is missing (tools/setup_gpu_peer.sh builds the binary; "
                             f"docs/results/2026-12-07-gpu-peers-plan.md)")
    engines = blockspec_engines(args.target, args.num_draft_tokens, args.device)
    tok = engines["plain"].tokenizer
    texts = [p for name in args.datasets.split(",") for p in load_eval_prompts(name, args.limit)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    lengths = [int(n) for n in args.draft_lengths.split(",")]
    sweep = peer.sweep_draft_length(args.target, prompts[:2], args.threads, args.max_tokens, lengths,
                                    binary=args.bin, draft_gguf=args.draft_gguf, extra=OFFLOAD)

    def llama(mode: str, n: int | None = None):
        def go() -> dict:
            outs = peer.run(mode, args.target, prompts, args.threads, args.max_tokens, n, args.bin, args.draft_gguf,
                            OFFLOAD)["outputs"]
            return {"tokens": [o["tokens"] for o in outs], "seconds": sum(o["seconds"] for o in outs),
                    "tau": None if mode == "plain" else peer.tau(outs)}
        return go

    rows = {("llama.cpp", "plain"): llama("plain"), ("llama.cpp", "dflash"): llama("dflash", sweep["best"])}
    rows |= {("blockspec", name): (lambda e=e: run_blockspec(e, prompts, args.max_tokens))
             for name, e in engines.items()}
    runs: dict[tuple[str, str], list[dict]] = {key: [] for key in rows}
    for r in range(args.repeats):
        for key, go in rows.items():
            out = go()
            out["rate"] = sum(len(t) for t in out["tokens"]) / out["seconds"]
            runs[key].append(out)
            print(f"repeat {r + 1}: {key[0]} {key[1]}: {out['rate']:.1f} tok/s", file=sys.stderr, flush=True)
    table = [{"engine": e, "mode": m, "tokens_per_second": round(statistics.median(x["rate"] for x in rs), 1),
              "runs_tokens_per_second": [round(x["rate"], 1) for x in rs],
              "tau": None if rs[0]["tau"] is None else round(rs[0]["tau"], 2)}
             | ({"draft_length": sweep["best"]} if (e, m) == ("llama.cpp", "dflash") else {})
             | ({"num_draft_tokens": args.num_draft_tokens} if e == "blockspec" and m.startswith("dflash") else {})
             for (e, m), rs in runs.items()]
    first = {key: rs[0]["tokens"] for key, rs in runs.items()}
    same = {f"{e} {m}": [first_difference(a, b) is None for a, b in zip(first[(e, m)], first[(e, p)])]
            for e, m, p in [("llama.cpp", "dflash", "plain"), ("blockspec", "dflash", "plain"),
                            ("blockspec", "dflash-bi", "plain-bi")] if (e, m) in first}
    rate = {f"{r['engine']} {r['mode']}": r["tokens_per_second"] for r in table}
    ratio = lambda a, b: round(rate[a] / rate[b], 2)  # noqa: E731
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = {"command": "python tools/gpu_peer_bench.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "llama_cpp": peer.version(args.bin),
              "datasets": args.datasets, "prompts": len(prompts), "max_tokens": args.max_tokens, "batch": 1,
              "sampling": "greedy", "llama_cpp_dflash_draft_length_sweep": sweep, "rows": table,
              "dflash_equals_own_plain": same,
              "ratios": {"blockspec dflash / llama.cpp dflash": ratio("blockspec dflash", "llama.cpp dflash"),
                         "blockspec dflash / llama.cpp plain": ratio("blockspec dflash", "llama.cpp plain"),
                         "blockspec plain / llama.cpp plain": ratio("blockspec plain", "llama.cpp plain")}}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for r in table:
        print(f"{r['engine']:9s} {r['mode']:9s} {r['tokens_per_second']:8.1f} tok/s"
              + (f", tau {r['tau']}" if r["tau"] else ""))
    print(json.dumps(report["ratios"]), "| DFlash == own plain:", {k: f"{sum(v)}/{len(v)}" for k, v in same.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
