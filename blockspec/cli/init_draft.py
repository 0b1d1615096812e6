"""`blockspec init-draft`: write a randomly initialized DFlash drafter (z-lab checkpoint format) for a target."""

from __future__ import annotations

import argparse

from blockspec.cli.config_flags import add_deprecated_alias
from blockspec.cli.flags import add_model_arg


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, "--target")
    p.add_argument("--out", required=True, help="output directory (z-lab DFlash checkpoint format)")
    p.add_argument("--draft-layers", type=int, default=1)
    block = p.add_argument("--draft-block-size", type=int, default=16, metavar="B",
                           help="the drafter's block: the given token and B - 1 drafts (default 16)")
    add_deprecated_alias(p, "--block-size", block)
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the last vocabulary id")
    p.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="every draft layer but the last attends causally over the W latest positions only (the "
                        "pattern of z-lab's Qwen3.6 and Gemma 4 drafters); default: every layer sees the whole context")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from blockspec.errors import BlockspecError
    from blockspec.loading.source import resolve_source
    from blockspec.models.config import ModelConfig
    from blockspec.train.export import init_draft

    if args.sliding_window is not None and args.sliding_window < 1:
        raise BlockspecError(f"--sliding-window={args.sliding_window} must be >= 1")
    src = resolve_source(args.target)
    out = init_draft(ModelConfig.from_hf(src.config, str(src.path)), args.out, args.draft_layers, args.draft_block_size,
                     args.mask_token_id, args.seed, sliding_window=args.sliding_window)
    print(f"wrote a randomly initialized DFlash drafter to {out}")
    return 0
