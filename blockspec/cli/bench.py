"""`blockspec bench`: offline throughput on synthetic prompts, plain and (with --draft) speculative, one run each;
--tensor-parallel-size N times one engine served by N ranks."""

from __future__ import annotations

import argparse
import json

from blockspec.cli.flags import (add_device_args, add_engine_args, add_max_batch_size, add_max_tokens, add_model_arg,
                                 add_speculative_args, add_speed_args, build_llm, engine_config, speculative_config)

# the flags the report repeats, under the names it has always used
_REPORTED = {"model": "model", "draft": "draft_model", "speculative_method": "method", "ngram_max": "ngram_max", "num_prompts": "num_prompts", "prompt_len": "prompt_len",
             "max_tokens": "max_tokens", "max_batch_size": "max_num_seqs", "num_draft_tokens": "num_draft_tokens",
             "full_block_drafting": "full_block_drafting", "cpu_packed": "cpu_packed",
             "cpu_bf16_draft": "cpu_bf16_draft", "draft_vocab_size": "draft_vocab_size",
             "batch_invariant": "batch_invariant"}


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    add_max_tokens(p, 64)
    add_max_batch_size(p, 8, "most requests decoded together")
    add_speculative_args(p, skip=["probabilistic_drafting"],
                         draft_model={"help": "DFlash drafter (or draft model with --speculative-method draft-model); "
                                                   "without it, and without --speculative-method ngram, only the "
                                                   "plain engine is timed"})
    add_speed_args(p)
    add_device_args(p)
    p.add_argument("--json", action="store_true")
    add_engine_args(p, ["enforce_eager", "tensor_parallel_size"])


def run(args: argparse.Namespace) -> int:
    spec = speculative_config(args)
    if args.tensor_parallel_size > 1:
        report = _bench_tensor_parallel(args)
    else:
        from blockspec.evaluation.throughput import bench, synthetic_prompts
        from blockspec.loading.loader import load_model

        lm = load_model(args.model, device=args.device, dtype=args.dtype, with_tokenizer=False,
                        cpu_packed=args.cpu_packed, batch_invariant=args.batch_invariant)
        draft = None
        if spec is not None:
            from blockspec.speculative.registry import load_proposer

            draft = load_proposer(spec, lm)
        prompts = synthetic_prompts(lm.config.vocab_size, args.num_prompts, args.prompt_len)
        report = bench(lm, draft, prompts, args.max_tokens, **engine_config(args))
    report["config"] = {key: getattr(args, dest) for key, dest in _REPORTED.items()}
    if args.json:
        print(json.dumps(report))
        return 0
    for mode in ("plain", "spec"):
        if mode in report:
            r = report[mode]
            tau = f", tau {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else ""
            print(f"{mode:5s}: {r['generated_tokens']} tokens in {r['time_s']:.2f}s = {r['tokens_per_second']:.1f} "
                  f"tok/s{tau}")
    if "speedup" in report:
        print(f"speedup spec/plain: {report['speedup']:.2f}x (outputs identical: {report['outputs_identical']})")
    return 0


def _bench_tensor_parallel(args: argparse.Namespace) -> dict:
    """Plain and (with --draft) speculative throughput of one tensor-parallel engine, as the one-device run reports."""
    from blockspec.evaluation.throughput import measure, report, synthetic_prompts
    from blockspec.sampling import SamplingParams

    llm = build_llm(args)
    try:
        prompts = synthetic_prompts(llm.lm.config.vocab_size, args.num_prompts, args.prompt_len)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        plain = measure(llm, prompts, params, speculate=False)
        spec = measure(llm, prompts, params) if llm.engine.proposer is not None else None
    finally:
        llm.close()
    return {**report(plain, spec), "tensor_parallel_size": args.tensor_parallel_size}
