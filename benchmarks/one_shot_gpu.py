"""One-shot `blockspec generate` against the warm engine on the GPU (issue 54, item 4): the decode rate the command
prints for a prompt, beside the rate of the same request on an engine that has already run it (graphs captured,
kernels compiled, nothing else to pay), same models and flags. Prints one JSON object.
Usage: python -m benchmarks.one_shot_gpu [--max-tokens 256] [--draft DIR] [--prompt TEXT]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from blockspec.config import EngineConfig
from blockspec.llm import LLM
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.sampling import SamplingParams

PROMPT = "Write a Python function that merges two sorted lists into one sorted list, with a docstring and tests."


def decode_rate(llm: LLM, ids: list[int], params: SamplingParams) -> float:
    """Tokens after the first over the time after it, as `generate` reports them."""
    first, n, t0 = None, 0, time.perf_counter()
    for out in llm.stream([ids], params):
        n += len(out.new_token_ids)
        if first is None and n:
            first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args(argv)
    draft = args.draft or str(bundled_draft_path())
    rows = {}
    for mode, flags in (("plain", []), ("dflash", ["--draft", draft])):
        cmd = [sys.executable, "-m", "blockspec", "generate", "--prompt", args.prompt, "--chat", "--json",
               "--max-tokens", str(args.max_tokens), *flags]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[1:])} exited {done.returncode}:\n{done.stderr.strip()}")
        one_shot = json.loads(done.stdout.strip().splitlines()[-1])
        llm = LLM(None, speculative={"draft_model": draft} if flags else None, engine=EngineConfig(max_num_seqs=1))
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        params = SamplingParams(max_tokens=args.max_tokens)
        warm = [decode_rate(llm, ids, params) for _ in range(3)][-1]
        rows[mode] = {"one_shot_tok_s": one_shot["tokens_per_second"], "warm_tok_s": round(warm, 1),
                      "ratio": round(one_shot["tokens_per_second"] / warm, 3),
                      "tau": one_shot.get("mean_acceptance_length"), "used": one_shot.get("draft_lens_used"),
                      "process_s": round(time.perf_counter() - t0, 1),
                      "warm_up_line": next((ln for ln in done.stderr.splitlines() if ln.startswith("warm-up")), None)}
        del llm
    print(json.dumps({"max_tokens": args.max_tokens, "prompt": args.prompt, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
