"""`blockspec generate|bench --tensor-parallel-size N`: the same commands served by N ranks through LLM."""

from __future__ import annotations

import argparse
import json
import sys
import time

from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingParams


def add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the target and drafter over N processes (GPUs: NCCL, one per rank; CPU: gloo)")


def _llm(args: argparse.Namespace):
    from blockspec.config import SpeculativeConfig
    from blockspec.llm import LLM

    spec = None
    if args.draft is not None:
        spec = SpeculativeConfig(draft_model=args.draft, num_draft_tokens=args.num_draft_tokens,
                                 probabilistic_drafting=getattr(args, "probabilistic_drafting", False))
    return LLM(args.model, spec, device=args.device, dtype=args.dtype,
               tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_batch_size,
               enforce_eager=getattr(args, "enforce_eager", False))


def generate_tp(args: argparse.Namespace, params: SamplingParams) -> int:
    if args.prompts_file is not None or args.trace:
        raise BlockspecError("--prompts-file and --trace are not supported with --tensor-parallel-size yet")
    llm = _llm(args)
    try:
        tok = llm.tokenizer
        if args.prompt_ids is not None:
            from blockspec.cli import _parse_ids

            prompt = _parse_ids(args.prompt_ids)
        elif tok is None:
            raise BlockspecError("this model has no tokenizer: pass --prompt-ids instead of --prompt")
        else:
            prompt = (tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                      else tok.encode(args.prompt))
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
    finally:
        llm.close()
    result = {
        "text": tok.decode(out.token_ids) if tok is not None else None, "token_ids": out.token_ids,
        "num_prompt_tokens": len(prompt), "num_generated_tokens": len(out.token_ids),
        "finish_reason": out.finish_reason, "time_s": round(elapsed, 4),
        "tokens_per_second": round(len(out.token_ids) / elapsed, 2) if elapsed > 0 else None,
        "acceptance_lengths": out.acceptance_lengths, "mean_acceptance_length": out.mean_acceptance_length,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"] if tok is not None else " ".join(map(str, out.token_ids)))
        print(f"[{len(out.token_ids)} tokens, {result['tokens_per_second']} tok/s, TP={args.tensor_parallel_size}]",
              file=sys.stderr)
    return 0


def bench_tp(args: argparse.Namespace) -> dict:
    """Plain and (with --draft) speculative throughput of one tensor-parallel engine, as `blockspec bench` reports."""
    from blockspec.bench.offline import measure, report, synthetic_prompts

    llm = _llm(args)
    try:
        prompts = synthetic_prompts(llm.lm.config.vocab_size, args.num_prompts, args.prompt_len)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        plain = measure(llm, prompts, params, speculate=False)
        spec = measure(llm, prompts, params) if args.draft is not None else None
    finally:
        llm.close()
    return {**report(plain, spec), "tensor_parallel_size": args.tensor_parallel_size}
