"""`blockspec train-draft`: train a DFlash drafter for a target (data from prompts or pre-built shards)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model (default: bundled SmolLM2-135M-Instruct)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", nargs="+", metavar="FILE", help="prompt files: the target writes the responses "
                     "into OUT/data first (reused if it exists); formats as for `blockspec draft-data`")
    src.add_argument("--data", nargs="+", metavar="DIR", help="pre-built training data directories (`blockspec "
                     "draft-data`), trained on together")
    p.add_argument("--out", required=True, help="output directory: the drafter (config.json + model.safetensors), "
                   "checkpoint.pt, train_log.jsonl, train_report.json")
    g = p.add_argument_group("drafter (new drafters; --init takes these from its config, except --draft-layers)")
    g.add_argument("--init", default=None, metavar="DIR", help="continue from an exported drafter")
    g.add_argument("--draft-layers", type=int, default=None, help="draft decoder layers (default 5); with --init, "
                   "grows the drafter to N layers, the new ones starting as the identity (it drafts as before)")
    g.add_argument("--block-size", type=int, default=None, help="block size B (default 16)")
    g.add_argument("--target-layer-ids", type=_ids, default=None, help="tapped target layers, e.g. 1,8,14,20,27 "
                   "(default: 5 spread over the depth)")
    g.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    g.add_argument("--mask-token-id", type=int, default=None, help="default: the last vocabulary id")
    t = p.add_argument_group("training")
    t.add_argument("--num-anchors", type=int, default=512, help="anchor blocks per sequence (at most)")
    t.add_argument("--epochs", type=int, default=6)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--batch-anchors", type=int, default=4096, help="anchor blocks per micro-batch")
    t.add_argument("--batch-tokens", type=int, default=None, help="target tokens per micro-batch (default: from "
                   "the data's tokens per anchor)")
    t.add_argument("--max-seq-len", type=int, default=3072, help="longer sequences are cut")
    t.add_argument("--loss-gamma", type=float, default=None, help="slot weight decay (default 7/5/4 for B 16/10/8)")
    t.add_argument("--walk-weight", type=float, default=0.0, help="extra loss weight of the blocks the verification "
                   "walk visits (where the engine's blocks start, right after a wrong draft); 0: off (the bundled "
                   "drafter's last stages used 2, then 4)")
    t.add_argument("--distill-weight", type=float, default=0.0, metavar="W", help="mix the target's own "
                   "next-token distribution into the labels: (1 - W) onehot + W p_target (0: hard labels, the paper's "
                   "loss; experimental)")
    t.add_argument("--prefix-weight", type=float, default=0.0, metavar="P", help="scale a slot's loss by 1 - P "
                   "where the drafter missed an earlier slot of its block (verification never reaches it there); 0: "
                   "off, 1: only reachable slots train (experimental)")
    t.add_argument("--opening-weight", type=float, default=0.0, metavar="W", help="extra loss weight of the blocks "
                   "anchored in a response's first --opening-tokens tokens, where acceptance is lowest; 0: off "
                   "(experimental)")
    t.add_argument("--opening-tokens", type=int, default=64, metavar="N",
                   help="what --opening-weight counts as a response's opening (default 64)")
    t.add_argument("--compile-draft", action="store_true", help="CUDA: run the draft layers under torch.compile, "
                   "fusing their element-wise work over the block rows (experimental: docs/training.md)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (resumable; the LR "
                   "schedule still spans all epochs)")
    t.add_argument("--time-limit", type=float, default=None, metavar="MIN", help="stop after MIN minutes of training "
                   "(checkpoint and export as at the end; --resume continues): for jobs with a wall-clock limit")
    t.add_argument("--save-every", type=int, default=500, help="optimizer steps between checkpoints")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto",
                   help="flex (CUDA default) or exact per-sequence SDPA (CPU default)")
    e = p.add_argument_group("evaluation (real tau with the engine, greedy)")
    e.add_argument("--eval-prompts", default=None, metavar="FILE", help="text lines or JSONL with prompt/prompt_ids")
    e.add_argument("--eval-set", default="gsm8k", help="shipped evaluation set when --eval-prompts is not given "
                   "(always excluded from training data)")
    e.add_argument("--eval-num-prompts", type=int, default=8, help="0 disables evaluation")
    e.add_argument("--eval-every", type=int, default=1000, help="optimizer steps between evaluations (0: at the end)")
    e.add_argument("--eval-max-tokens", type=int, default=256)
    e.add_argument("--val-fraction", type=float, default=0.0,
                   help="training sequences held out and scored at every evaluation: loss, per-slot accuracy and "
                        "block acceptance length next to the training windows' (shows overfitting); e.g. 0.02")
    d = p.add_argument_group("data generation (--prompts)")
    d.add_argument("--gen-max-tokens", type=int, default=1024, help="longest regenerated response")
    d.add_argument("--prompt-limit", type=int, default=None, help="use only the first N prompts")
    d.add_argument("--no-chat", action="store_true", help="do not apply the chat template (prompts and eval)")
    d.add_argument("--all-turns", action="store_true",
                   help="every user turn of a conversation becomes a prompt (default: first turns only, since later "
                        "turns such as 'continue' make no sense without their conversation)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="target dtype (default: bfloat16 on CUDA, float32 on CPU); the drafter trains in fp32 "
                        "master weights with bf16 autocast on CUDA")


def run(args: argparse.Namespace) -> int:
    from blockspec.data.shards import read_shards
    from blockspec.errors import BlockspecError
    from blockspec.loading.loader import load_model
    from blockspec.train.config import TrainConfig
    from blockspec.train.dataset import prepare
    from blockspec.train.setup import DraftShape, draft_from, new_draft
    from blockspec.train.trainer import train

    cfg = TrainConfig(
        num_anchors=args.num_anchors, epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio, grad_clip=args.grad_clip, grad_accum=args.grad_accum,
        batch_anchors=args.batch_anchors, batch_tokens=args.batch_tokens, max_seq_len=args.max_seq_len,
        seed=args.seed, loss_gamma=args.loss_gamma, max_steps=args.max_steps, time_limit_min=args.time_limit,
        save_every=args.save_every, eval_every=args.eval_every, eval_max_tokens=args.eval_max_tokens,
        attention=args.attention, val_fraction=args.val_fraction, walk_weight=args.walk_weight,
        distill_weight=args.distill_weight, prefix_weight=args.prefix_weight, opening_weight=args.opening_weight,
        opening_tokens=args.opening_tokens, compile_draft=args.compile_draft,
    )
    if args.eval_num_prompts < 0:
        raise BlockspecError(f"--eval-num-prompts must be >= 0, got {args.eval_num_prompts}")
    shape_flags = {"--block-size": args.block_size,
                   "--target-layer-ids": args.target_layer_ids, "--intermediate-size": args.intermediate_size,
                   "--mask-token-id": args.mask_token_id}
    if args.init is not None and any(v is not None for v in shape_flags.values()):
        given = [k for k, v in shape_flags.items() if v is not None]
        raise BlockspecError(f"{', '.join(given)} cannot be combined with --init (the drafter's shape comes from "
                             f"{args.init}/config.json; only --draft-layers may add layers)")
    lm = load_model(args.target, device=args.device, dtype=args.dtype)
    device = next(lm.model.parameters()).device
    eval_prompts = _eval_prompts(lm, args)
    out = Path(args.out)
    data_dirs = [Path(d) for d in args.data] if args.data is not None else [_generate(lm, args, out / "data")]
    seqs = []
    for data_dir in data_dirs:
        part = read_shards(data_dir)
        top = max((int(s.input_ids.max()) for s in part if len(s.input_ids)), default=0)
        if top >= lm.config.vocab_size:
            raise BlockspecError(f"{data_dir}: token id {top} is outside the target's vocabulary "
                                 f"[0, {lm.config.vocab_size}): the data was made for another target")
        seqs += part
    if args.init is not None:
        setup = draft_from(lm, args.init, device, args.draft_layers, args.seed)
    else:
        shape = DraftShape(**{k: v for k, v in {
            "num_layers": args.draft_layers, "block_size": args.block_size, "target_layer_ids": args.target_layer_ids,
            "intermediate_size": args.intermediate_size, "mask_token_id": args.mask_token_id}.items() if v is not None})
        setup = new_draft(lm, shape, args.seed, device)
    data = prepare(seqs, cfg, " + ".join(map(str, data_dirs)))
    report = train(lm, setup, data, cfg, out, eval_prompts, resume=args.resume)
    tau = f", tau {report['tau']:.3f}" if report["tau"] is not None else ""
    if report["val"] is not None:
        tau += f", held-out block tau {report['val']['tau']:.2f}, walk tau {report['val']['walk_tau']:.2f}"
    print(f"trained {report['steps']} steps on {report['target_tokens']} target tokens in {report['train_time_s']}s "
          f"({report['tokens_per_s']} tokens/s){tau}; drafter written to {out}", file=sys.stderr)
    return 0


def _generate(lm, args: argparse.Namespace, data_dir: Path) -> Path:
    """OUT/data from --prompts (the target regenerates every response), unless an earlier run already wrote it."""
    if (data_dir / "manifest.json").is_file():
        print(f"reusing training data in {data_dir}", file=sys.stderr)
        return data_dir
    from blockspec.data.builder import build_dataset
    from blockspec.data.prompts import read_prompts
    from blockspec.errors import BlockspecError

    if args.prompt_limit is not None and args.prompt_limit < 1:
        raise BlockspecError(f"--prompt-limit must be >= 1, got {args.prompt_limit}")
    found = read_prompts(args.prompts, first_turn_only=not args.all_turns)
    build_dataset(lm, found.prompts[: args.prompt_limit], data_dir, max_tokens=args.gen_max_tokens,
                  chat=not args.no_chat, seed=args.seed, meta={"prompt_files": found.summary()})
    return data_dir


def _eval_prompts(lm, args: argparse.Namespace) -> list[list[int]]:
    """Held-out prompts as token ids: the first N of --eval-prompts, or of the shipped --eval-set."""
    from blockspec.data.builder import encode_prompts
    from blockspec.errors import BlockspecError

    n = args.eval_num_prompts
    if n == 0:
        return []
    tok = lm.tokenizer
    chat = not args.no_chat and tok is not None and tok.has_chat_template
    if args.eval_prompts is not None:
        from blockspec.prompts_file import read_prompts_file

        specs = read_prompts_file(args.eval_prompts)[:n]
        if tok is None and any(s.prompt_ids is None for s in specs):
            raise BlockspecError(f"{args.eval_prompts}: text prompts need a tokenizer, and the target has none; "
                                 f"use prompt_ids")
        return [s.prompt_ids if s.prompt_ids is not None else encode_prompts(lm, [s.prompt], chat)[0]
                for s in specs]
    if tok is None:
        raise BlockspecError("the target has no tokenizer: give --eval-prompts with prompt_ids, or "
                             "--eval-num-prompts 0")
    from blockspec.data.eval_prompts import load_eval_prompts

    return encode_prompts(lm, load_eval_prompts(args.eval_set, n), chat)
