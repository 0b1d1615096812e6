"""`blockspec generate|bench --tensor-parallel-size N`: the same commands served by N ranks through LLM."""

from __future__ import annotations

import argparse
import time

from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingParams


def add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the target and drafter over N processes (GPUs: NCCL, one per rank; CPU: gloo)")


def _llm(args: argparse.Namespace):
    from blockspec.cli import speculative_config
    from blockspec.llm import LLM

    return LLM(args.model, speculative_config(args), device=args.device, dtype=args.dtype, cpu_packed=args.cpu_packed,
               batch_invariant=args.batch_invariant, tensor_parallel_size=args.tensor_parallel_size,
               max_num_seqs=args.max_batch_size,
               enforce_eager=getattr(args, "enforce_eager", False))


def generate_tp(args: argparse.Namespace, params: SamplingParams) -> int:
    from blockspec.cli import generation_result, print_result, prompt_from_args

    if args.prompts_file is not None or args.trace:
        raise BlockspecError("--prompts-file and --trace are not supported with --tensor-parallel-size yet")
    llm = _llm(args)
    try:
        prompt = prompt_from_args(args, llm.tokenizer, llm.lm.source.name)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
    finally:
        llm.close()
    result = generation_result(llm.tokenizer, prompt, out.token_ids, out.finish_reason, elapsed)
    if args.draft is not None:
        result.update(acceptance_lengths=out.acceptance_lengths, mean_acceptance_length=out.mean_acceptance_length)
    result["tensor_parallel_size"] = args.tensor_parallel_size
    print_result(args, result, llm.tokenizer, streamed=False)
    return 0


def bench_tp(args: argparse.Namespace) -> dict:
    """Plain and (with --draft) speculative throughput of one tensor-parallel engine, as `blockspec bench` reports."""
    from blockspec.evaluation.throughput import measure, report, synthetic_prompts

    llm = _llm(args)
    try:
        prompts = synthetic_prompts(llm.lm.config.vocab_size, args.num_prompts, args.prompt_len)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        plain = measure(llm, prompts, params, speculate=False)
        spec = measure(llm, prompts, params) if args.draft is not None else None
    finally:
        llm.close()
    return {**report(plain, spec), "tensor_parallel_size": args.tensor_parallel_size}
