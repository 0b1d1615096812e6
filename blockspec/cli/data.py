"""`blockspec draft-data`: build drafter training data (target-regenerated responses as token shards) on its own."""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from blockspec.cli.flags import (add_device_args, add_dist_timeout_arg, add_max_batch_size, add_max_tokens,
                                 add_model_arg, add_sampling_args, add_speculative_args, add_speed_args, load_config,
                                 report_plan, speculative_config)

if TYPE_CHECKING:
    from blockspec.config import SpeculativeConfig
    from blockspec.data.prompt_set import PromptSet
    from blockspec.data.shards import Manifest
    from blockspec.loading.draft_loader import LoadedDraft
    from blockspec.loading.loader import LoadedModel
    from blockspec.train.distributed import DataParallel

# A rank that finishes its chunks waits for the slowest at the merge: as long as generation may take.
MERGE_TIMEOUT = timedelta(days=2)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, "--target")
    p.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                   help="JSONL, JSON array / ShareGPT (may be truncated), .txt (one per line), or .py files / "
                        "directories of them (code prompts)")
    p.add_argument("--out", required=True, help="output directory (manifest.json + shard-*.safetensors)")
    add_max_tokens(p, 1024, "longest response generated per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="skip prompts longer than this (templated)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts read")
    add_sampling_args(p, filters=False, seed=0, seed_help="sampling seed of prompt i is seed + i")
    add_max_batch_size(p, None, "requests generated together (default: 256 on CUDA, 8 on CPU)")
    p.add_argument("--first-turn-only", action="store_true", help="only the first user turn of each conversation")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_speculative_args(p, ["draft_model", "num_draft_tokens"], draft_model={
        "metavar": "SRC", "help": "generate with speculative decoding using this DFlash drafter of the target (greedy "
                                  "only; same data, less time)"})
    add_device_args(p)
    add_speed_args(p, cpu_packed=False, cpu_quant=False)  # the data is the target's own answers
    add_dist_timeout_arg(p, "under torchrun (each rank generates a share of the prompts, rank 0 merges them; "
                            "docs/training.md): how long the ranks wait for each other at set-up")


def run(args: argparse.Namespace) -> int:
    from blockspec.data.prompts import read_prompts
    from blockspec.errors import BlockspecError
    from blockspec.train.launch import join, launched, session

    if args.limit is not None and args.limit < 1:
        raise BlockspecError(f"--limit must be >= 1, got {args.limit}")
    spec = speculative_config(args)
    dp = join(args.device, args.dist_timeout, op_timeout=MERGE_TIMEOUT) if launched() else None
    main = dp is None or dp.main
    with session(dp):
        found = read_prompts(args.prompts, first_turn_only=args.first_turn_only)
        for f in found.files if main else ():
            print(f"{f.path}: {f.num_records} records, {len(f.prompts)} prompts", file=sys.stderr)
            if f.note:
                print(f"  note: {f.note}", file=sys.stderr)
        manifest = _build(args, spec, found, found.prompts[: args.limit], dp)
    m = manifest.meta
    if main:
        print(f"wrote {manifest.num_sequences} sequences ({manifest.num_tokens} tokens, "
              f"{manifest.num_response_tokens} response tokens) in {len(manifest.shards)} shard(s) to {args.out}; "
              f"dropped {m['num_excluded_eval']} evaluation prompts, {m['num_duplicates']} duplicates, "
              f"{m['num_skipped_length']} by length")
    return 0


def _build(args: argparse.Namespace, spec: SpeculativeConfig | None, found: PromptSet, prompts: list[str],
           dp: DataParallel | None) -> Manifest:
    """Load the target (and drafter) and write the data; under torchrun each rank generates a share of the
    prompts, a failure to load on one rank ends every rank with its message."""
    from blockspec.loading.loader import load_model
    from blockspec.train.data_builder import build_dataset

    def load() -> tuple[LoadedModel, LoadedDraft | None]:
        device = args.device if dp is None else str(dp.device)
        lm = load_model(args.target, load_config(args, device=device))
        if spec is None:
            return lm, None
        from blockspec.loading.draft_loader import load_draft

        return lm, load_draft(spec, lm)

    lm, draft = load() if dp is None else dp.together(load)
    ranks = {} if dp is None else {"rank": dp.rank, "world_size": dp.world_size, "sync": dp.together}
    manifest = build_dataset(
        lm, prompts, args.out, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        chat=not args.no_chat, max_prompt_tokens=args.max_prompt_tokens, max_num_seqs=args.max_num_seqs,
        meta={"prompt_files": found.summary(), "first_turn_only": args.first_turn_only, "limit": args.limit,
              "draft": args.draft_model},
        draft=draft, **ranks,
    )
    if dp is None or dp.main:  # after the run: a refusal anywhere before it stays one line
        report_plan(lm.plan.with_proposer(draft))
    return manifest
