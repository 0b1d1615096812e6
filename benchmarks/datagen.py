"""Data-generation throughput at the bundled pair's shape (what `blockspec draft-data` runs), from one run: a
SmolLM2-135M-shaped target with random weights and a 4-layer block-16 drafter, `batch` requests at a time, prompts of
50-300 random tokens and responses of 60-256 tokens (requests finish at different steps, so admissions meet decoding
requests as in real data generation), acceptance forced to `tau` (benchmark-only: random weights accept nothing),
min_admit = batch / 16 as draft-data sets it. One row per EngineConfig.split_mixed_steps setting, each with the
engine's host-side breakdown. Usage (GPU):
  python -m benchmarks.datagen [--batch 512] [--K 7] [--tau 3.5] [--requests 4096] [--out FILE]"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from benchmarks.random_pair import make_pair
from benchmarks.stage_times import observe
from blockspec.config import EngineConfig
from blockspec.llm import LLM
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams
from blockspec.speculative.acceptance import ForcedAcceptance

SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
TAPS, MASK = [1, 8, 14, 20, 27], 49151


def workload(n: int, vocab: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int], seed: int = 0
             ) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    # greedy; the seeds key the forced acceptance (a request without one gets a random seed)
    params = [SamplingParams(max_tokens=rng.randint(*new_tokens), ignore_eos=True, seed=seed + i) for i in range(n)]
    return prompts, params


def measure(lm: LoadedModel, draft: LoadedDraft, batch: int, tau: float, prompts: list[list[int]],
            params: list[SamplingParams], split: bool) -> dict:
    """Generate the workload once to warm up (CUDA graphs of every bucket it reaches are captured there), then
    again timed; tokens/s and the host breakdown of the timed run."""
    mean_prompt = sum(map(len, prompts)) // len(prompts)
    kv = batch * (mean_prompt + max(p.max_tokens for p in params) + 2 * draft.spec.num_draft_tokens + 2)
    llm = LLM.from_loaded(lm, draft, acceptance=ForcedAcceptance(tau),
                          engine=EngineConfig(max_num_seqs=batch, kv_cache_tokens=kv, min_admit=max(1, batch // 16),
                                              max_num_batched_tokens=16384, split_mixed_steps=split,
                                              enable_prefix_caching=False))  # the timed run must not hit the warm-up's prompts
    llm.generate(prompts, params, use_tqdm=False)
    host = observe(llm.engine)
    sync = torch.cuda.synchronize if lm.model.lm_head.weight.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    acc = [a for o in outs for a in o.acceptance_lengths]
    del llm
    gc.collect()
    return {"split_mixed_steps": split, "batch": batch, "requests": len(prompts), "tokens": tokens,
            "time_s": round(dt, 3), "tokens_per_second": round(tokens / dt, 1),
            "measured_tau": round(sum(acc) / len(acc), 3) if acc else None,
            "host_breakdown_s": {k: round(v, 4) for k, v in host.totals.items()}, "token_ids": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--tau", type=float, default=3.5)
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    lm, draft = make_pair(SMOLLM2_135M, args.K, 4, TAPS, MASK, torch.device("cuda"), torch.bfloat16)
    prompts, params = workload(args.requests, SMOLLM2_135M["vocab_size"], (50, 300), (60, 256))
    rows = []
    for split in (False, True):
        r = measure(lm, draft, args.batch, args.tau, prompts, params, split)
        r.pop("token_ids")
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"split_mixed_steps on / off: {rows[1]['tokens_per_second'] / rows[0]['tokens_per_second']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
