"""`blockspec train-draft`: train a DFlash (or, with --arch dflash2, DFlash 2) drafter for a target (data from prompts
or pre-built shards)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from blockspec.cli.config_flags import add_config_flags, add_deprecated_alias, flags_given, name_the_flag
from blockspec.cli.flags import add_device_args, add_dist_timeout_arg, add_model_arg, report_plan
from blockspec.train.config import DFLASH2_DEFAULTS, DraftArch, TrainConfig

if TYPE_CHECKING:
    from blockspec.loading.loader import LoadedModel
    from blockspec.train.dataset import TrainingSet
    from blockspec.train.distributed import DataParallel
    from blockspec.train.trainer import DraftSetup

T = TypeVar("T")

# the TrainConfig flags listed under evaluation in --help
_EVAL_FIELDS = ("eval_every", "eval_max_tokens", "val_fraction")


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, "--target")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", nargs="+", metavar="FILE", help="prompt files: the target writes the responses "
                     "into OUT/data first (reused if it exists); formats as for `blockspec draft-data`")
    src.add_argument("--data", nargs="+", metavar="DIR", help="pre-built training data directories (`blockspec "
                     "draft-data`), trained on together")
    p.add_argument("--out", required=True, help="output directory: the drafter (config.json + model.safetensors), "
                   "checkpoint.pt, train_log.jsonl, train_report.json")
    g = p.add_argument_group("drafter (new drafters; --init takes these from its config, except --draft-layers and "
                             "--arch dflash2)")
    g.add_argument("--init", default=None, metavar="DIR", help="continue from an exported drafter")
    g.add_argument("--draft-layers", type=int, default=None, help="draft decoder layers (default 5); with --init, "
                   "grows the drafter to N layers, the new ones starting as the identity (it drafts as before)")
    block = g.add_argument("--draft-block-size", type=int, default=None, metavar="B",
                           help="the drafter's block: the given token and B - 1 drafts (default 16)")
    add_deprecated_alias(g, "--block-size", block)
    g.add_argument("--target-layer-ids", type=_ids, default=None, help="tapped target layers, e.g. 1,8,14,20,27 "
                   "(default: 5 spread over the depth)")
    g.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    g.add_argument("--mask-token-id", type=int, default=None, help="default: the last vocabulary id")
    g.add_argument("--sliding-window", type=int, default=None, metavar="W", help="every draft layer but the last "
                   "attends causally over the W latest positions only (as z-lab's Qwen3.6 / Gemma 4 drafters)")
    add_config_flags(g, DraftArch)
    t = p.add_argument_group("training")
    add_config_flags(t, TrainConfig, skip=_EVAL_FIELDS)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    e = p.add_argument_group("evaluation (real tau with the engine, greedy)")
    e.add_argument("--eval-prompts", default=None, metavar="FILE", help="text lines or JSONL with prompt/prompt_ids")
    e.add_argument("--eval-set", default="gsm8k", help="shipped evaluation set when --eval-prompts is not given "
                   "(always excluded from training data)")
    e.add_argument("--eval-num-prompts", type=int, default=None, help="0 disables evaluation (default 8; 0 with "
                   "--fsdp, where no rank holds the whole target for the engine)")
    add_config_flags(e, TrainConfig, _EVAL_FIELDS)
    d = p.add_argument_group("data generation (--prompts)")
    d.add_argument("--gen-max-tokens", type=int, default=1024, help="longest regenerated response")
    d.add_argument("--prompt-limit", type=int, default=None, help="use only the first N prompts")
    d.add_argument("--no-chat", action="store_true", help="do not apply the chat template (prompts and eval)")
    d.add_argument("--all-turns", action="store_true",
                   help="every user turn of a conversation becomes a prompt (default: first turns only, since later "
                        "turns such as 'continue' make no sense without their conversation)")
    add_device_args(p, dtype_help="target dtype (default: bfloat16 on CUDA, float32 on CPU); the drafter trains in "
                                  "fp32 master weights with bf16 autocast on CUDA")
    r = p.add_argument_group("several GPUs or hosts: launch with `torchrun --nproc-per-node N -m blockspec "
                             "train-draft ...` (docs/training.md), --grad-accum a multiple of the world size")
    r.add_argument("--fsdp", action="store_true", help="shard the frozen target's decoder layers over the ranks, for "
                   "a target that does not fit one device (needs torchrun and --data)")
    add_dist_timeout_arg(r, "how long the ranks wait for each other at set-up")


def run(args: argparse.Namespace) -> int:
    from blockspec.cli.inputs import check_path
    from blockspec.errors import BlockspecError
    from blockspec.train.distributed import check_global_batch
    from blockspec.train.launch import join, launched, session, world

    cfg = TrainConfig(**flags_given(args, TrainConfig))
    arch = _draft_arch(args)
    if args.eval_num_prompts is not None and args.eval_num_prompts < 0:
        raise BlockspecError(f"--eval-num-prompts must be >= 0, got {args.eval_num_prompts}")
    shape_flags = {"--draft-block-size": args.draft_block_size,
                   "--target-layer-ids": args.target_layer_ids, "--intermediate-size": args.intermediate_size,
                   "--mask-token-id": args.mask_token_id, "--sliding-window": args.sliding_window}
    if args.init is not None and any(v is not None for v in shape_flags.values()):
        given = [k for k, v in shape_flags.items() if v is not None]
        raise BlockspecError(f"{', '.join(given)} cannot be combined with --init (the drafter's shape comes from "
                             f"{args.init}/config.json; only --draft-layers may add layers)")
    if args.draft_block_size is not None and args.draft_block_size < 2:
        raise BlockspecError(f"--draft-block-size={args.draft_block_size} must be >= 2 (slot 0 holds the given token)")
    # read after the target has loaded (_train): a missing one should not wait for it
    for path in args.prompts or ():
        check_path(path, "--prompts", "path")
    if args.init is not None:
        check_path(args.init, "--init", "dir")
    if args.fsdp:
        _check_fsdp(args, launched())
    dp = None
    if launched():
        check_global_batch(cfg.grad_accum, world()[1])  # before the rendezvous: every rank says it, none waits
        dp = join(args.device, args.dist_timeout, fsdp=args.fsdp)
    with session(dp):
        report = _train(args, cfg, arch, dp)
    if dp is None or dp.main:
        tau = f", tau {report['tau']:.3f}" if report["tau"] is not None else ""
        if report["val"] is not None:
            tau += f", held-out block tau {report['val']['tau']:.2f}, walk tau {report['val']['walk_tau']:.2f}"
        print(f"trained {report['steps']} steps on {report['target_tokens']} target tokens in "
              f"{report['train_time_s']}s ({report['tokens_per_s']} tokens/s){tau}; drafter written to {args.out}",
              file=sys.stderr)
    return 0


def _draft_arch(args: argparse.Namespace) -> DraftArch:
    """--arch and the DFlash 2 fields, checked against each other and against --init before anything loads."""
    from blockspec.errors import BlockspecError, ConfigError

    given = flags_given(args, DraftArch)
    try:
        arch = DraftArch(**given)
    except ConfigError as e:
        raise name_the_flag(e, DraftArch) from None
    fields = ["--" + k.replace("_", "-") for k in DFLASH2_DEFAULTS if k in given]
    if fields and not arch.dflash2:
        where = (f"{args.init}/config.json gives them" if args.init is not None and arch.arch is None else
                 "DFlash 1 has no such fields")
        raise BlockspecError(f"{', '.join(fields)}: DFlash 2 fields, for --arch dflash2 only ({where})")
    if args.init is not None and arch.arch == "dflash":
        raise BlockspecError(f"--arch dflash cannot be combined with --init (the drafter's architecture comes from "
                             f"{args.init}/config.json; --arch dflash2 --init upgrades a DFlash 1 drafter)")
    if args.init is None and not arch.dflash2 and "selector_weight" in flags_given(args, TrainConfig):
        raise BlockspecError("--selector-weight applies to DFlash 2 drafters only (--arch dflash2)")
    return arch


def _check_fsdp(args: argparse.Namespace, is_rank: bool) -> None:
    from blockspec.errors import BlockspecError

    if not is_rank:
        raise BlockspecError("--fsdp shards the target over the ranks of a distributed launch, and this process is "
                             "not one: `torchrun --nproc-per-node N -m blockspec train-draft --fsdp ...`")
    if args.prompts is not None:
        raise BlockspecError("--fsdp needs --data: the engine that writes the responses for --prompts runs the whole "
                             "target on one device (build the data first with `blockspec draft-data`)")
    if args.eval_num_prompts:
        raise BlockspecError(f"--eval-num-prompts {args.eval_num_prompts} with --fsdp: no rank holds the whole target "
                             f"to run the engine's tau evaluation (use --val-fraction, and eval-draft afterwards)")


def _train(args: argparse.Namespace, cfg: TrainConfig, arch: DraftArch, dp: DataParallel | None) -> dict[str, Any]:
    """Load the target, the data and the drafter (on every rank under torchrun; a failure on one rank ends every
    rank with its message), then train."""
    from blockspec.loading.loader import LoadConfig, load_model
    from blockspec.train.trainer import train

    def together(fn: Callable[[], T]) -> T:
        return fn() if dp is None else dp.together(fn)

    if dp is None:
        device, dtype = args.device, args.dtype
    else:  # a sharded target is read into host memory first: it need not fit one device
        device = "cpu" if dp.fsdp else str(dp.device)
        dtype = args.dtype or ("bfloat16" if dp.device.type == "cuda" else None)
    lm = together(lambda: load_model(args.target, LoadConfig(device=device, dtype=dtype)))
    if dp is not None and dp.fsdp:
        from blockspec.train.fsdp import shard_target

        shard_target(lm.model, dp)
    eval_prompts = together(lambda: _eval_prompts(lm, args))
    out = Path(args.out)
    data_dirs = [Path(d) for d in args.data] if args.data is not None else [_generate(lm, args, out / "data", dp)]
    setup, data = together(lambda: _draft_and_data(lm, args, cfg, arch, data_dirs, dp))
    report = train(lm, setup, data, cfg, out, eval_prompts, resume=args.resume, dp=dp)
    if dp is None or dp.main:  # after the run: a refusal anywhere before it stays one line
        report_plan(lm.plan)
    return report


def _draft_and_data(lm: LoadedModel, args: argparse.Namespace, cfg: TrainConfig, arch: DraftArch,
                    data_dirs: list[Path], dp: DataParallel | None) -> tuple[DraftSetup, TrainingSet]:
    from blockspec.data.shards import read_shards
    from blockspec.errors import BlockspecError
    from blockspec.models.dflash2 import DFlash2DraftModel
    from blockspec.train.dataset import prepare
    from blockspec.train.setup import DraftShape, draft_from, new_draft

    seqs = []
    for data_dir in data_dirs:
        part = read_shards(data_dir)
        top = max((int(s.input_ids.max()) for s in part if len(s.input_ids)), default=0)
        if top >= lm.config.vocab_size:
            raise BlockspecError(f"{data_dir}: token id {top} is outside the target's vocabulary "
                                 f"[0, {lm.config.vocab_size}): the data was made for another target")
        seqs += part
    device = dp.device if dp is not None else next(lm.model.parameters()).device
    dflash2 = arch.dflash2_fields() if arch.dflash2 else None
    if args.init is not None:
        setup = draft_from(lm, args.init, device, args.draft_layers, args.seed, dflash2)
        if "selector_weight" in flags_given(args, TrainConfig) and not isinstance(setup.model, DFlash2DraftModel):
            raise BlockspecError(f"--selector-weight applies to DFlash 2 drafters only, and {args.init} is a DFlash 1 "
                                 f"drafter (--arch dflash2 upgrades it)")
    else:
        shape = DraftShape(**{k: v for k, v in {
            "num_layers": args.draft_layers, "block_size": args.draft_block_size,
            "target_layer_ids": args.target_layer_ids, "intermediate_size": args.intermediate_size,
            "mask_token_id": args.mask_token_id, "dflash2": dflash2,
            "sliding_window": args.sliding_window}.items() if v is not None})
        setup = new_draft(lm, shape, args.seed, device)
    return setup, prepare(seqs, cfg, " + ".join(map(str, data_dirs)))


def _generate(lm: LoadedModel, args: argparse.Namespace, data_dir: Path, dp: DataParallel | None) -> Path:
    """OUT/data from --prompts (the target regenerates every response; under torchrun each rank a share of the
    prompts), unless an earlier run already wrote it."""
    if (data_dir / "manifest.json").is_file():
        if dp is None or dp.main:
            print(f"reusing training data in {data_dir}", file=sys.stderr)
        return data_dir
    from blockspec.data.prompts import read_prompts
    from blockspec.errors import BlockspecError
    from blockspec.train.data_builder import build_dataset

    if args.prompt_limit is not None and args.prompt_limit < 1:
        raise BlockspecError(f"--prompt-limit must be >= 1, got {args.prompt_limit}")
    found = read_prompts(args.prompts, first_turn_only=not args.all_turns)
    build_dataset(lm, found.prompts[: args.prompt_limit], data_dir, max_tokens=args.gen_max_tokens,
                  chat=not args.no_chat, seed=args.seed, meta={"prompt_files": found.summary()},
                  **({} if dp is None else {"rank": dp.rank, "world_size": dp.world_size, "sync": dp.together}))
    return data_dir


def _eval_prompts(lm, args: argparse.Namespace) -> list[list[int]]:
    """Held-out prompts as token ids: the first N of --eval-prompts, or of the shipped --eval-set."""
    from blockspec.data.prompts import encode_prompts
    from blockspec.errors import BlockspecError

    n = args.eval_num_prompts if args.eval_num_prompts is not None else (0 if args.fsdp else 8)
    if n == 0:
        return []
    tok = lm.tokenizer
    chat = not args.no_chat and tok is not None and tok.has_chat_template
    if args.eval_prompts is not None:
        from blockspec.data.prompts_file import read_prompts_file

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
