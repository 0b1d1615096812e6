"""Model and engine flags shared by `blockspec serve` and `blockspec chat`, and the LLM they build."""

from __future__ import annotations

import argparse

# flag -> EngineConfig field; only flags given on the command line are passed, so EngineConfig keeps the defaults
_ENGINE_FLAGS = {
    "max_num_seqs": (int, "most requests running at once"),
    "max_num_batched_tokens": (int, "rows per target forward: prefill chunk tokens + verify rows"),
    "block_size": (int, "tokens per KV page"),
    "num_kv_blocks": (int, "KV pool size in blocks (default: from --kv-cache-tokens)"),
    "kv_cache_tokens": (int, "KV pool size in tokens when --num-kv-blocks is not given"),
    "max_model_len": (int, "context length (default: the model's max_position_embeddings)"),
    "attention_backend": (str, "torch | triton | auto (triton on CUDA)"),
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="DFlash draft checkpoint (directory or hub id): speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="K drafts per block (default: block_size - 1)")
    p.add_argument("--probabilistic-drafting", action="store_true", help="sample drafts and use p/q rejection")
    p.add_argument("--full-block-drafting", action="store_true",
                   help="draft with the drafter's trained block size, verify the first K drafts")
    from blockspec.cli import add_speed_args

    add_speed_args(p)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    for name, (kind, help_text) in _ENGINE_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--draft-len-schedule", default=None, metavar="B:K,...",
                   help="draft length by batch size, e.g. 1:15,16:7,64:3 (K of the largest B <= the running batch)")
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs (same results, slower)")


def model_source(args: argparse.Namespace) -> str | None:
    from blockspec.errors import BlockspecError

    if args.model_pos is not None and args.model is not None and args.model_pos != args.model:
        raise BlockspecError(f"two models given: {args.model_pos!r} and --model {args.model!r}; pass one")
    return args.model if args.model is not None else args.model_pos


def build_llm(args: argparse.Namespace):
    """The LLM (target, optional drafter, engine) the flags describe; raises BlockspecError for bad flags."""
    from blockspec.cli import speculative_config
    from blockspec.llm import LLM

    spec = speculative_config(args)
    engine = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    if args.no_prefix_caching:
        engine["enable_prefix_caching"] = False
    if args.enforce_eager:
        engine["enforce_eager"] = True
    if args.draft_len_schedule is not None:
        engine["draft_len_schedule"] = parse_schedule(args.draft_len_schedule)
    return LLM(model_source(args), speculative_config=spec, device=args.device, dtype=args.dtype,
               cpu_packed=args.cpu_packed, batch_invariant=args.batch_invariant, **engine)


def parse_schedule(text: str) -> dict[int, int]:
    """"1:15,16:7" -> {1: 15, 16: 7}; the values are checked by EngineConfig."""
    from blockspec.errors import BlockspecError

    try:
        return {int(b): int(k) for b, k in (item.split(":") for item in text.split(",") if item.strip())}
    except ValueError:
        raise BlockspecError(f"--draft-len-schedule {text!r}: expected batch:K pairs separated by commas, e.g. "
                             f"1:15,16:7,64:3") from None
