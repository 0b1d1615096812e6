"""The llama.cpp side of tools/cpu_peer_bench.py, run by the peer venv's python (llama-cpp-python, never installed
into .venv). Reads one JSON job on stdin, writes one JSON result on stdout:
  {"gguf": PATH, "threads": N, "prompts": [[ids]...], "max_tokens": N, "stop": [ids]}
    -> {"system_info", "version", "outputs": [{"tokens": [...], "seconds": s}...]}: greedy decoding of each prompt
       (the token ids given, no template applied here), timed from the prompt's evaluation to the last token;
  with "teacher": [[ids]...] instead of "prompts" (and "starts": [n...]): {"argmax": [[...]...]}, llama.cpp's argmax
       after each position from the n-th on, one evaluation per sequence."""

from __future__ import annotations

import json
import sys
import time

import llama_cpp
import numpy as np


def decode(llm: llama_cpp.Llama, prompt: list[int], max_tokens: int, stop: set[int]) -> dict:
    llm.reset()  # no prefix reuse across prompts
    tokens: list[int] = []
    start = time.perf_counter()
    # temp 0 with top_k 1: the argmax, no penalties
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        if tok in stop or len(tokens) == max_tokens:
            break
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def main() -> int:
    job = json.loads(sys.stdin.read())
    teacher = "teacher" in job
    llm = llama_cpp.Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"],
                          n_ctx=1024, logits_all=teacher, verbose=False, seed=0)
    out = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    if teacher:
        argmax = []
        for seq, n in zip(job["teacher"], job["starts"]):
            llm.reset()
            llm.eval(seq)
            argmax.append(np.asarray(llm.scores[n - 1:len(seq) - 1]).argmax(-1).tolist())
        out["argmax"] = argmax
    else:
        stop = set(job["stop"])
        decode(llm, job["prompts"][0], 4, stop)  # warm-up: first-call costs stay out of the timings
        out["outputs"] = [decode(llm, p, job["max_tokens"], stop) for p in job["prompts"]]
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
