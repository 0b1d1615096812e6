"""blockspec against llama.cpp on the CPU, side by side (docs/perf.md, "CPU peers"): the bundled SmolLM2-135M-Instruct
Q4_1 GGUF, the demo's 10 prompts through the same chat template (the same token ids go to both), greedy, the same
max tokens and thread counts; per repeat and thread count llama.cpp plain, blockspec plain and blockspec DFlash run
one after the other (interleaved), and the medians over repeats go to docs/perf/cpu_peers.json with the kernels that
ran, the load of the machine, and where llama.cpp's greedy output differs from ours (and how far each is from the
fp32 model dequantized from the same file: teacher-forced top-1 agreement).

llama.cpp runs through llama-cpp-python in its own venv, never in .venv:
  python3 -m venv .cache/peer-venv
  .cache/peer-venv/bin/pip install .cache/wheels/llama_cpp_python-0.3.36-*.whl   # built from the registry's sdist
  .venv/bin/python tools/cpu_peer_bench.py [--repeats 3] [--threads 1,2] [--cpu-quant auto]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from blockspec.config import SpeculativeConfig
from blockspec.demo import CPU_DRAFT_TOKENS, CPU_DRAFT_VOCAB, CPU_QUANT_DRAFT_TOKENS, DEMO_PROMPTS
from blockspec.layers import cpu_packed, cpu_quant
from blockspec.llm import LLM
from blockspec.loading.bundled import bundled_default_path
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from cpu_quant_agreement import argmaxes  # tools/, next to this script

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tools" / "llama_cpp_worker.py"
CPU = torch.device("cpu")


def busy_cpus(samples: int = 10) -> float:
    """CPUs kept busy by other processes now: runnable tasks (the 4th field of /proc/loadavg) less this one,
    averaged over a second (the load average also counts this benchmark's own previous run)."""
    busy = []
    for _ in range(samples):
        busy.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        time.sleep(0.1)
    return sum(busy) / samples


def wait_quiet(limit: float, patience_s: float) -> dict:
    """Wait (up to patience_s) until other processes keep fewer than `limit` CPUs busy; what was seen."""
    start = time.time()
    busy = busy_cpus()
    while busy >= limit and time.time() - start < patience_s:
        print(f"  machine busy ({busy:.1f} CPUs in use by others): waiting", file=sys.stderr, flush=True)
        time.sleep(30)
        busy = busy_cpus()
    return {"busy_cpus": busy, "loadavg_1m": os.getloadavg()[0], "waited_s": round(time.time() - start)}


def llama_cpp(python: Path, job: dict) -> dict:
    done = subprocess.run([str(python), str(WORKER)], input=json.dumps(job), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp worker failed:\n{done.stderr}")
    return json.loads(done.stdout)


def run_blockspec(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt as one request, timed like the demo (prompt processing included)."""
    tokens, seconds, acc = [], 0.0, []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([ids], SamplingParams(max_tokens=max_tokens), use_tqdm=False)[0]
        seconds += time.perf_counter() - start
        tokens.append(out.token_ids)
        acc += out.acceptance_lengths or []
    return {"tokens": tokens, "seconds": seconds, "tau": sum(acc) / len(acc) if acc else None}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cpu-quant", default="auto", help="blockspec's target linears (auto|q8|q4|off)")
    ap.add_argument("--peer-python", type=Path, default=ROOT / ".cache" / "peer-venv" / "bin" / "python")
    ap.add_argument("--max-busy", type=float, default=0.5, help="wait while others keep this many CPUs busy")
    ap.add_argument("--patience", type=float, default=900, help="seconds to wait for a quiet machine per repeat")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "perf" / "cpu_peers.json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    gguf = bundled_default_path()
    lm = load_model(None, LoadConfig(device="cpu", cpu_packed=cpu_packed.fp32_supported(CPU), cpu_quant=args.cpu_quant))
    K = CPU_DRAFT_TOKENS if lm.cpu_quant == "off" else CPU_QUANT_DRAFT_TOKENS
    bf16 = cpu_packed.bf16_supported(CPU)
    draft = load_draft(SpeculativeConfig(draft_model=str(bundled_draft_path()), num_draft_tokens=K,
                                         full_block_drafting=True, cpu_bf16_draft=bf16,
                                         draft_vocab_size=CPU_DRAFT_VOCAB), lm)
    # every prompt processed in full, as llama.cpp (reset before each prompt) does: no prefix reuse on either side
    plain = LLM.from_loaded(lm, None, max_num_seqs=1, enable_prefix_caching=False)
    spec = LLM.from_loaded(lm, draft, max_num_seqs=1, enable_prefix_caching=False)
    prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    for llm in (plain, spec):
        llm.generate([prompts[0]], SamplingParams(max_tokens=4), use_tqdm=False)
    job = {"gguf": str(gguf), "prompts": prompts, "max_tokens": args.max_tokens, "stop": lm.stop_token_ids}
    runs: dict[tuple[str, str, int], list[dict]] = {}
    loads, info = [], {}
    for r in range(args.repeats):
        loads.append(wait_quiet(args.max_busy, args.patience))
        for t in threads:
            print(f"repeat {r + 1}/{args.repeats}, {t} thread(s)", file=sys.stderr, flush=True)
            peer = llama_cpp(args.peer_python, {**job, "threads": t})
            info = {k: peer[k] for k in ("version", "system_info")}
            outs = peer["outputs"]
            runs.setdefault(("llama.cpp", "plain", t), []).append(
                {"tokens": [o["tokens"] for o in outs], "seconds": sum(o["seconds"] for o in outs), "tau": None})
            torch.set_num_threads(t)
            runs.setdefault(("blockspec", "plain", t), []).append(run_blockspec(plain, prompts, args.max_tokens))
            runs.setdefault(("blockspec", "dflash", t), []).append(run_blockspec(spec, prompts, args.max_tokens))
        loads[-1]["after"] = busy_cpus()
    rows = []
    for (engine, mode, t), rs in runs.items():
        rates = [sum(len(x) for x in run["tokens"]) / run["seconds"] for run in rs]
        rows.append({"engine": engine, "mode": mode, "threads": t,
                     "tokens_per_second": round(statistics.median(rates), 1),
                     "tau": None if rs[0]["tau"] is None else round(rs[0]["tau"], 2),
                     "runs_tokens_per_second": [round(x, 1) for x in rates]})
    ours = runs[("blockspec", "plain", threads[-1])][0]["tokens"]
    theirs = runs[("llama.cpp", "plain", threads[-1])][0]["tokens"]
    spec_out = runs[("blockspec", "dflash", threads[-1])][0]["tokens"]
    agreement = teacher_forced_agreement(args, lm, prompts, gguf)
    report = {
        "command": "python tools/cpu_peer_bench.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load": loads},
        "model": gguf.name, "prompts": len(prompts), "max_tokens": args.max_tokens, "sampling": "greedy",
        "tokens_per_second": "generated tokens / wall time of each request, prompt processing included (no prefix "
                             "reuse on either side), summed over the prompts; median over repeats",
        "kernels": {
            "llama.cpp": f"llama-cpp-python {info.get('version')}, {info.get('system_info')}; the file's Q4_1 / "
                         f"Q8_0 tensors with 8-bit quantized activations",
            "blockspec": f"target: fp32 activations, linears: {cpu_quant.kernel_name(lm.cpu_quant)}, lm_head: "
                         f"{type(lm.model.lm_head).__name__}; drafter: {'bf16' if bf16 else 'fp32'} oneDNN-packed, "
                         f"K = {K}, full-block drafting, draft vocabulary {CPU_DRAFT_VOCAB}"},
        "rows": rows,
        "outputs": {
            "blockspec_dflash_equals_plain": [a == b for a, b in zip(spec_out, ours)],
            "llama_cpp_equals_blockspec_plain": [a == b for a, b in zip(theirs, ours)],
            "first_difference_llama_cpp_vs_blockspec": [first_difference(a, b) for a, b in zip(theirs, ours)],
            "top1_agreement_with_fp32": agreement},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for row in rows:
        print(f"{row['engine']:10s} {row['mode']:6s} {row['threads']} thread(s): {row['tokens_per_second']:6.1f} tok/s"
              + (f", tau {row['tau']:.2f}" if row["tau"] else ""))
    by = {(r["engine"], r["mode"], r["threads"]): r["tokens_per_second"] for r in rows}
    for t in threads:
        base = by[("llama.cpp", "plain", t)]
        print(f"{t} thread(s): blockspec plain {by[('blockspec', 'plain', t)] / base:.2f}x, DFlash "
              f"{by[('blockspec', 'dflash', t)] / base:.2f}x llama.cpp plain")
    print(f"wrote {args.out}")
    return 0


def teacher_forced_agreement(args: argparse.Namespace, lm, prompts: list[list[int]], gguf: Path) -> dict:
    """The fp32 model's greedy answers (dequantized from the same file) fed through blockspec's quantized target and
    through llama.cpp: how often each one's argmax is the fp32 model's token."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    ref = load_model(None, LoadConfig(device="cpu"))
    answers = [o.token_ids for o in LLM.from_loaded(ref, None, max_num_seqs=1)
               .generate(prompts, SamplingParams(max_tokens=args.max_tokens), use_tqdm=False)]
    seqs = [p + a for p, a in zip(prompts, answers)]
    total = sum(len(a) for a in answers)
    peer = llama_cpp(args.peer_python, {"gguf": str(gguf), "threads": os.cpu_count() or 1, "teacher": seqs,
                                        "starts": [len(p) for p in prompts]})
    agree_peer = sum(x == y for am, a in zip(peer["argmax"], answers) for x, y in zip(am, a))
    agree_ours = sum(x == y for p, a in zip(prompts, answers) for x, y in zip(argmaxes(lm, p + a)[len(p) - 1:-1], a))
    return {"tokens": total, "llama.cpp": round(agree_peer / total, 4), "blockspec": round(agree_ours / total, 4)}


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
