"""`blockspec demo`: the flags of the README's main command; what it runs is blockspec/demo.py."""

from __future__ import annotations

import argparse

from blockspec.cli.flags import add_cpu_quant_arg, add_device_args, add_max_tokens, add_model_arg, add_speculative_args

# the demo runs the GGUF's quantized weights as they are (Q4_1 codes in the int4 kernel): plain decoding reads 4x
# fewer weight bytes than the fp32 path; the outputs are the quantized model's
# (docs/results/2026-12-05-cpu-quant-llama-cpp.md)
DEMO_CPU_QUANT = "auto"


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    add_max_tokens(p, 96)
    add_device_args(p, device="cpu", dtype=False)
    add_speculative_args(p, ["num_draft_tokens"], num_draft_tokens={
        "help": "K drafts per block for the bundled drafter, throughout (default: as generate --draft: the step costs "
                "measured on this machine, K re-picked from the live acceptance, docs/usage.md)"})
    p.add_argument("--fp32-draft", action="store_true",
                   help="keep the drafter in fp32 on CPUs with bf16 units too (what CPUs without them run)")
    add_cpu_quant_arg(p, DEMO_CPU_QUANT)


def run(args: argparse.Namespace) -> int:
    from blockspec.demo import run_demo

    return run_demo(args.model, args.max_tokens, args.device, args.num_draft_tokens, fp32_draft=args.fp32_draft,
                    cpu_quant=args.cpu_quant)
