"""Host-side cost of an engine decode step (scheduler, input buffers, block tables, result unpacking, commit), on the
CPU, with the decode step's model forward replaced by a stand-in that accepts n drafts per request: on the GPU the
forward is one CUDA graph replay, and this is the Python work around it that the GPU waits for at large batches.
Usage: python -m benchmarks.host [--batch 512] [--K 7] [--accept 2] [--repeats 3]"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.datagen import workload
from benchmarks.random_pair import make_pair
from blockspec.config import EngineConfig
from blockspec.engine.decode_step import DecodeStep
from blockspec.llm import LLM

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True)


def stand_in(accept: int):
    """A DecodeStep.forward that emits the bonus + drafts shifted by one, accepts `accept` drafts and drafts 7s."""
    def forward(self: DecodeStep, buf, rows, next_k: int) -> tuple[torch.Tensor, None]:
        B, K1 = buf.input_ids.shape
        n = torch.full((B, 1), min(accept, K1 - 1), dtype=torch.long)
        return torch.cat([(buf.input_ids + 1) % 500, n, torch.full((B, next_k), 7, dtype=torch.long)], dim=1), None
    return forward


def decode_step_ms(batch: int, K: int, accept: int, new_tokens: int = 256) -> float:
    """Median wall ms of the engine steps in which every request decodes (all admitted at once, same length)."""
    lm, draft = make_pair(TINY, K, 1, [0, 1], 511, torch.device("cpu"), torch.float32)
    real = DecodeStep.forward
    DecodeStep.forward = stand_in(accept)  # type: ignore[method-assign]
    try:
        prompts, _ = workload(batch, 500, (50, 300), (1, 1))
        llm = LLM.from_loaded(lm, draft,
                              engine=EngineConfig(max_num_seqs=batch,
                                                  kv_cache_tokens=batch * (300 + new_tokens + 2 * K + 2),
                                                  max_num_batched_tokens=1 << 20, min_admit=batch))
        engine = llm.engine
        params = workload(1, 500, (1, 1), (new_tokens, new_tokens))[1][0]
        for p in prompts:
            engine.add_request(p, params)
        times = []
        while engine.has_unfinished():
            decoding = bool(engine.scheduler.running) and not any(s.in_prefill for s in engine.scheduler.running)
            t = time.perf_counter()
            engine.step(finished_only=True)
            if decoding:
                times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)
    finally:
        DecodeStep.forward = real  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--accept", type=int, default=2, help="drafts accepted per step (tau = accept + 1)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for b in args.batch:
        runs = [decode_step_ms(b, args.K, args.accept) for _ in range(args.repeats)]
        print(json.dumps({"batch": b, "K": args.K, "accept": args.accept, "host_ms_per_step": round(min(runs), 3),
                          "runs_ms": [round(r, 3) for r in runs]}), flush=True)


if __name__ == "__main__":
    main()
