"""`blockspec bench`: offline throughput, plain and (with --draft) speculative, on the first prompts of a shipped
evaluation set (default HumanEval, chat template applied when the model has one) or on random token ids (labelled
so: they overstate tau and the speedup); timed as evaluation/throughput.py times (warmed engines, alternating runs,
medians; under --tensor-parallel-size N one engine served by N ranks times every run)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from blockspec.cli.flags import (add_device_args, add_engine_args, add_max_batch_size, add_max_tokens, add_model_arg,
                                 add_speculative_args, add_speed_args, engine_config, load_config, report_plan,
                                 speculative_config)
from blockspec.config import EngineConfig, default_draft_len_schedule
from blockspec.data.eval_prompts import EVAL_SETS

if TYPE_CHECKING:
    from blockspec.loading.loader import LoadedModel
    from blockspec.sampling import SamplingParams

RANDOM, RANDOM_LEN = "random", 64

# the flags the report repeats, under the names it has always used
_REPORTED = {"model": "model", "draft": "draft_model", "speculative_method": "method", "ngram_max": "ngram_max",
             "prompts": "prompts", "num_prompts": "num_prompts", "prompt_len": "prompt_len",
             "max_tokens": "max_tokens", "max_batch_size": "max_num_seqs", "num_draft_tokens": "num_draft_tokens",
             "full_block_drafting": "full_block_drafting", "cpu_packed": "cpu_packed", "cpu_quant": "cpu_quant",
             "cpu_bf16_draft": "cpu_bf16_draft", "draft_vocab_size": "draft_vocab_size",
             "batch_invariant": "batch_invariant", "repeats": "repeats", "first": "first"}


def add_timing_args(p: argparse.ArgumentParser) -> None:
    """--repeats and --first: how many timed runs per mode, and which mode leads the alternating order."""
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per mode, alternating plain, spec, spec, plain, ...; the medians are reported "
                        "(default 2)")
    p.add_argument("--first", default="plain", choices=["plain", "spec"], help="the mode that runs first")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--prompts", default=None, choices=[*EVAL_SETS, RANDOM],
                   help="the first --num-prompts prompts of a shipped evaluation set, or random token ids (synthetic: "
                        "they overstate tau and the speedup) (default: humaneval; random when --prompt-len is given)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=None, help=f"tokens per random prompt (default {RANDOM_LEN})")
    add_max_tokens(p, 64)
    add_max_batch_size(p, 8, "most requests decoded together")
    add_speculative_args(p, skip=["probabilistic_drafting"],
                         draft_model={"help": "DFlash drafter (or draft model with --speculative-method draft-model); "
                                                   "without it, and without --speculative-method ngram, only the "
                                                   "plain engine is timed"})
    add_speed_args(p)
    add_timing_args(p)
    add_device_args(p)
    p.add_argument("--json", action="store_true")
    add_engine_args(p, ["enforce_eager", "overlap", "tensor_parallel_size", "draft_len_schedule"])


def prompt_set(args: argparse.Namespace) -> str:
    """--prompts, resolved: --prompt-len alone means random prompts (as bench always took them)."""
    from blockspec.errors import BlockspecError

    chosen = args.prompts or (RANDOM if args.prompt_len is not None else "humaneval")
    if chosen != RANDOM and args.prompt_len is not None:
        raise BlockspecError(f"--prompt-len is the length of --prompts random prompts; {chosen} prompts keep their own")
    if args.num_prompts < 1:
        raise BlockspecError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    return chosen


def bench_prompts(lm: LoadedModel, args: argparse.Namespace, chosen: str) -> tuple[list[list[int]], dict]:
    """Token ids of the prompts bench times, and what they are (the report's `prompts`)."""
    from blockspec.errors import BlockspecError

    if chosen == RANDOM:
        from blockspec.evaluation.throughput import synthetic_prompts

        length = args.prompt_len or RANDOM_LEN
        return (synthetic_prompts(lm.config.vocab_size, args.num_prompts, length),
                {"set": RANDOM, "random_tokens": True, "num_prompts": args.num_prompts, "prompt_len": length})
    from blockspec.data.eval_prompts import load_eval_prompts
    from blockspec.data.prompts import encode_prompts

    texts = load_eval_prompts(chosen)
    if args.num_prompts > len(texts):
        raise BlockspecError(f"--num-prompts {args.num_prompts}: {chosen} has {len(texts)} prompts (repeats would be "
                             f"prefix-cache hits)")
    if lm.tokenizer is None:
        raise BlockspecError(f"{lm.source.name} has no tokenizer to encode {chosen} prompts: pass --prompts random")
    chat = lm.tokenizer.has_chat_template
    return (encode_prompts(lm, texts[: args.num_prompts], chat=chat),
            {"set": chosen, "random_tokens": False, "num_prompts": args.num_prompts, "chat_template": chat})


def _params(described: dict, max_tokens: int) -> SamplingParams:
    from blockspec.sampling import SamplingParams

    # an end-of-text token means nothing in random prompts; real answers stop there, as when served
    return SamplingParams(max_tokens=max_tokens, ignore_eos=described["random_tokens"])


def run(args: argparse.Namespace) -> int:
    from blockspec.evaluation.throughput import bench
    from blockspec.llm import load_models

    spec = speculative_config(args)
    chosen = prompt_set(args)
    # the spec engine runs the draft length schedule measured on this machine unless one (or K) is given
    default = default_draft_len_schedule(getattr(args, "num_draft_tokens", None))
    engine = EngineConfig(**{"draft_len_schedule": default, **engine_config(args)})
    models = load_models(args.model, load_config(args, with_tokenizer=chosen != RANDOM), spec,
                         engine.tensor_parallel_size)
    prompts, described = bench_prompts(models.lm, args, chosen)
    report_plan(models.plan)
    report = bench(models.lm, models.draft, prompts, _params(described, args.max_tokens), args.repeats, args.first,
                   engine=engine, sources=models.sources)
    report["prompts"] = {**described, **report.get("prompts", {})}  # bench's own notes on them (prefix caching)
    report["config"] = {**{key: getattr(args, dest) for key, dest in _REPORTED.items()}, "prompts": chosen}
    print(json.dumps(report) if args.json else _text(report))
    return 0


def _text(report: dict) -> str:
    p = report["prompts"]
    lines = [f"prompts: {p['num_prompts']} RANDOM-TOKEN prompts of {p['prompt_len']} tokens (synthetic: tau and "
             f"speedup overstate real text)" if p["random_tokens"] else
             f"prompts: the first {p['num_prompts']} of {p['set']}"
             f"{' (chat template)' if p['chat_template'] else ''}"]
    for mode in ("plain", "spec"):
        if mode in report:
            r = report[mode]
            tau = f", tau {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else ""
            lines.append(f"{mode:5s}: {r['generated_tokens']} tokens in {r['time_s']:.2f}s = "
                         f"{r['tokens_per_second']:.1f} tok/s{tau} (median of {len(r['runs_time_s'])} runs, spread "
                         f"{r['time_spread']:.0%})")
            if r.get("draft_len_schedule"):
                lines.append("       draft length schedule (batch:K) "
                             + ", ".join(f"{b}:{k}" for b, k in sorted(r["draft_len_schedule"].items())))
            if r.get("draft_lens_used"):
                lines.append("       draft lengths used (K:steps, engine warm-up included) " + "; ".join(
                    ", ".join(f"{k}:{n}" for k, n in sorted(u.items())) for u in r["draft_lens_used"]))
            if missed := sum(len(c) for c in r["runs_kernel_compiles"]):
                lines.append(f"       {missed} Triton compiles inside the timed runs: this speed is understated")
    if "speedup" in report:
        lo, hi = report["speedup_range"]
        lines.append(f"speedup spec/plain: {report['speedup']:.2f}x (range {lo:.2f}-{hi:.2f}x; outputs identical: "
                     f"{report['outputs_identical']})")
    lines.append(f"run order: {' '.join(report['timing']['order'])} (each run on an engine warmed up first)")
    return "\n".join(lines)

