"""`blockspec draft-data`: build drafter training data (target-regenerated responses as token shards) on its own."""

from __future__ import annotations

import argparse
import sys

from blockspec.cli.flags import (add_device_args, add_max_batch_size, add_max_tokens, add_model_arg, add_sampling_args,
                                 add_speculative_args, add_speed_args, speculative_config)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, "--target")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                   help="JSONL, JSON array / ShareGPT (may be truncated), .txt (one per line), or .py files / "
                        "directories of them (code prompts)")
    p.add_argument("--out", required=True, help="output directory (manifest.json + shard-*.safetensors)")
    add_max_tokens(p, 1024, "longest response generated per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="skip prompts longer than this (templated)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts read")
    add_sampling_args(p, top_k_p=False, seed=0, seed_help="sampling seed of prompt i is seed + i")
    add_max_batch_size(p, None, "requests generated together (default: 256 on CUDA, 8 on CPU)")
    p.add_argument("--first-turn-only", action="store_true", help="only the first user turn of each conversation")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_speculative_args(p, ["draft_model", "num_draft_tokens"], draft_model={
        "metavar": "SRC", "help": "generate with speculative decoding using this DFlash drafter of the target (greedy "
                                  "only; same data, less time)"})
    add_device_args(p)
    add_speed_args(p, cpu_packed=False)


def run(args: argparse.Namespace) -> int:
    from blockspec.data.builder import build_dataset
    from blockspec.data.prompts import read_prompts
    from blockspec.errors import BlockspecError
    from blockspec.loading.loader import load_model

    if args.limit is not None and args.limit < 1:
        raise BlockspecError(f"--limit must be >= 1, got {args.limit}")
    spec = speculative_config(args)
    found = read_prompts(args.prompts, first_turn_only=args.first_turn_only)
    for f in found.files:
        print(f"{f.path}: {f.num_records} records, {len(f.prompts)} prompts", file=sys.stderr)
        if f.note:
            print(f"  note: {f.note}", file=sys.stderr)
    prompts = found.prompts[: args.limit]
    lm = load_model(args.target, device=args.device, dtype=args.dtype, batch_invariant=args.batch_invariant)
    draft = None
    if spec is not None:
        from blockspec.loading.draft_loader import load_draft

        draft = load_draft(spec, lm)
    manifest = build_dataset(
        lm, prompts, args.out, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        chat=not args.no_chat, max_prompt_tokens=args.max_prompt_tokens, max_num_seqs=args.max_num_seqs,
        meta={"prompt_files": found.summary(), "first_turn_only": args.first_turn_only, "limit": args.limit,
              "draft": args.draft_model},
        draft=draft,
    )
    m = manifest.meta
    print(f"wrote {manifest.num_sequences} sequences ({manifest.num_tokens} tokens, {manifest.num_response_tokens} "
          f"response tokens) in {len(manifest.shards)} shard(s) to {args.out}; dropped {m['num_excluded_eval']} "
          f"evaluation prompts, {m['num_duplicates']} duplicates, {m['num_skipped_length']} by length")
    return 0
