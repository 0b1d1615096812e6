"""`blockspec demo`: the flags of the README's main command; what it runs is blockspec/demo.py."""

from __future__ import annotations

import argparse

from blockspec.cli.flags import add_device_args, add_max_tokens, add_model_arg, add_speculative_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    add_max_tokens(p, 96)
    add_device_args(p, device="cpu", dtype=False)
    add_speculative_args(p, ["num_draft_tokens"], num_draft_tokens={
        "help": "K drafts per block for the bundled drafter (default: 4 on CPU, where K = 3-5 measure best, see "
                "docs/perf.md; block_size - 1 elsewhere)"})
    p.add_argument("--fp32-draft", action="store_true",
                   help="keep the drafter in fp32 on CPUs with bf16 units too (what CPUs without them run)")


def run(args: argparse.Namespace) -> int:
    from blockspec.demo import run_demo

    return run_demo(args.model, args.max_tokens, args.device, args.num_draft_tokens, fp32_draft=args.fp32_draft)
