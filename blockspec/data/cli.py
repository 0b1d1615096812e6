"""`blockspec draft-data`: build drafter training data (target-regenerated responses as token shards) on its own."""

from __future__ import annotations

import argparse
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                   help="JSONL, JSON array / ShareGPT (may be truncated), .txt (one per line), or .py files / "
                        "directories of them (code prompts)")
    p.add_argument("--out", required=True, help="output directory (manifest.json + shard-*.safetensors)")
    p.add_argument("--max-tokens", type=int, default=1024, help="longest response generated per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="skip prompts longer than this (templated)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts read")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy responses")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    p.add_argument("--max-batch-size", type=int, default=None, help="requests generated together (default: 256 on "
                                                                      "CUDA, 8 on CPU)")
    p.add_argument("--first-turn-only", action="store_true", help="only the first user turn of each conversation")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--draft", default=None, metavar="SRC",
                   help="generate with speculative decoding using this DFlash drafter of the target (greedy only; "
                        "same data, less time)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="drafts verified per step with --draft (default: the drafter's block size - 1)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-invariant", action="store_true",
                   help="GPU: with --draft, responses equal plain decoding's token for token in bf16 too "
                        "(docs/ARCHITECTURE.md, batch invariance)")


def run(args: argparse.Namespace) -> int:
    from blockspec.data.builder import build_dataset
    from blockspec.data.prompts import read_prompts
    from blockspec.errors import BlockspecError
    from blockspec.loading.loader import load_model

    if args.limit is not None and args.limit < 1:
        raise BlockspecError(f"--limit must be >= 1, got {args.limit}")
    if args.num_draft_tokens is not None and args.draft is None:
        raise BlockspecError("--num-draft-tokens needs --draft")
    found = read_prompts(args.prompts, first_turn_only=args.first_turn_only)
    for f in found.files:
        print(f"{f.path}: {f.num_records} records, {len(f.prompts)} prompts", file=sys.stderr)
        if f.note:
            print(f"  note: {f.note}", file=sys.stderr)
    prompts = found.prompts[: args.limit]
    lm = load_model(args.target, device=args.device, dtype=args.dtype, batch_invariant=args.batch_invariant)
    draft = None
    if args.draft is not None:
        from blockspec.config import SpeculativeConfig
        from blockspec.loading.draft_loader import load_draft

        draft = load_draft(SpeculativeConfig(draft_model=args.draft, num_draft_tokens=args.num_draft_tokens), lm)
    manifest = build_dataset(
        lm, prompts, args.out, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        chat=not args.no_chat, max_prompt_tokens=args.max_prompt_tokens, max_num_seqs=args.max_batch_size,
        meta={"prompt_files": found.summary(), "first_turn_only": args.first_turn_only, "limit": args.limit,
              "draft": args.draft},
        draft=draft,
    )
    m = manifest.meta
    print(f"wrote {manifest.num_sequences} sequences ({manifest.num_tokens} tokens, {manifest.num_response_tokens} "
          f"response tokens) in {len(manifest.shards)} shard(s) to {args.out}; dropped {m['num_excluded_eval']} "
          f"evaluation prompts, {m['num_duplicates']} duplicates, {m['num_skipped_length']} by length")
    return 0
