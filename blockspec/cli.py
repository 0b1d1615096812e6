"""`blockspec` command line. Subcommands register themselves in COMMANDS; user errors print one line, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Callable

from blockspec.errors import BlockspecError

if TYPE_CHECKING:
    from blockspec.config import SpeculativeConfig


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise BlockspecError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    return ids


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: bundled SmolLM2-135M-Instruct)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts-file", help="many prompts: text (one per line) or JSONL with prompt/prompt_ids[/max_tokens]")
    p.add_argument("--max-batch-size", type=int, default=32, help="most requests decoded together (--prompts-file)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (--prompts-file; same results, slower)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")
    p.add_argument("--draft", default=None, help="DFlash draft checkpoint (directory or hub id): speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="K drafts per block (default: block_size - 1)")
    p.add_argument("--probabilistic-drafting", action="store_true",
                   help="sample drafts from the draft distribution and use p/q rejection (default: argmax drafts)")
    p.add_argument("--full-block-drafting", action="store_true",
                   help="draft with the drafter's trained block size and verify the first K drafts (pays when K + 1 "
                        "is below the block size and drafting is cheap next to verifying)")
    add_speed_args(p)
    p.add_argument("--trace", action="store_true", help="report every step's drafts and number accepted")
    from blockspec.distributed.cli import add_tp_arg

    add_tp_arg(p)


def add_speed_args(p: argparse.ArgumentParser) -> None:
    """--cpu-packed, --cpu-bf16-draft and --draft-vocab-size: cheaper steps, same precision of the target (shared by
    generate, bench, serve, chat and eval-draft)."""
    p.add_argument("--cpu-packed", action="store_true",
                   help="CPU: pack the target's (and the drafter's) linears once for oneDNN, in their own dtype "
                        "(plain and verify steps read the weights faster; a verify step of K + 1 rows costs about a "
                        "1-row one)")
    p.add_argument("--cpu-bf16-draft", action="store_true",
                   help="CPU: run the drafter in bf16 on weights packed once for oneDNN (needs AVX512-BF16 or AMX); "
                        "the target still verifies every draft in its own dtype, so outputs do not change")
    p.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                   help="argmax drafts over token ids < N only (a smaller draft head; outputs do not change)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="GPU: the target's GEMMs and attention computed the same way whatever the batch, so greedy "
                        "speculative output equals plain decoding token for token in bf16 too (slower GEMMs)")


# the drafter flags a command may register, with their defaults (SpeculativeConfig fields of the same names)
_DRAFT_FLAGS = {"num_draft_tokens": None, "probabilistic_drafting": False, "full_block_drafting": False,
                "cpu_bf16_draft": False, "draft_vocab_size": None, "trace": False}


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The SpeculativeConfig of --draft and the drafter flags this command registered; None without --draft, where
    any drafter flag given is an error that names it."""
    given = {k: getattr(args, k) for k, default in _DRAFT_FLAGS.items() if getattr(args, k, default) != default}
    if args.draft is None:
        if given:
            names = [f"--{k.replace('_', '-')}" for k in given]
            listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            raise BlockspecError(f"{listed} need{'s' if len(names) == 1 else ''} --draft")
        return None
    from blockspec.config import SpeculativeConfig

    given.pop("trace", None)  # a report option, not a drafter setting
    return SpeculativeConfig(draft_model=args.draft, **given)


def cmd_generate(args: argparse.Namespace) -> int:
    from blockspec.llm import LLM
    from blockspec.loading.detokenizer import IncrementalDecoder
    from blockspec.loading.loader import load_model
    from blockspec.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    spec = speculative_config(args)
    if args.tensor_parallel_size > 1:
        from blockspec.distributed.cli import generate_tp

        return generate_tp(args, params)
    lm = load_model(args.model, device=args.device, dtype=args.dtype, cpu_packed=args.cpu_packed,
                    batch_invariant=args.batch_invariant)
    draft = None
    if spec is not None:
        from blockspec.loading.draft_loader import load_draft

        draft = load_draft(spec, lm)
    tok = lm.tokenizer
    if args.prompts_file is not None:
        from blockspec.batch_cli import run_prompts_file

        return run_prompts_file(args, lm, draft, params)
    prompt_ids = prompt_from_args(args, tok, lm.source.name)
    # one request through the batched engine (the same step, and on CUDA the same graphs, as every other path), with
    # a KV pool just large enough for it
    K = draft.spec.num_draft_tokens if draft is not None else 0
    cap = min(len(prompt_ids) + params.max_tokens, lm.config.max_position_embeddings) + K + 1
    llm = LLM.from_loaded(lm, draft, max_num_seqs=1, num_kv_blocks=max(2, -(-cap // 16) + 1),
                          enforce_eager=args.enforce_eager)
    decoder = IncrementalDecoder(tok) if tok is not None and not args.json else None
    t0 = time.perf_counter()
    final = None
    for final in llm.stream([prompt_ids], params):
        if decoder is not None:
            sys.stdout.write(decoder.push(final.new_token_ids))
            sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    result = generation_result(tok, prompt_ids, final.token_ids, final.finish_reason, elapsed)
    if draft is not None:
        result["acceptance_lengths"] = final.acceptance_lengths
        result["mean_acceptance_length"] = final.mean_acceptance_length
        if args.trace:
            result["steps"] = [s.to_dict() for s in final.steps or []]
    print_result(args, result, tok, streamed=decoder is not None)
    return 0


def prompt_from_args(args: argparse.Namespace, tok, model_name: str) -> list[int]:
    """The prompt token ids of --prompt-ids, or of --prompt (with --chat: in the chat template)."""
    if args.prompt_ids is not None:
        if args.chat:
            raise BlockspecError("--chat needs --prompt text, not --prompt-ids")
        return _parse_ids(args.prompt_ids)
    if tok is None:
        raise BlockspecError(f"{model_name} has no tokenizer: pass --prompt-ids instead of --prompt")
    return tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)


def generation_result(tok, prompt_ids: list[int], tokens: list[int], reason: str | None, elapsed: float) -> dict:
    """The `generate --json` object (speculative fields are added by the caller)."""
    return {
        "text": tok.decode(tokens) if tok is not None else None,
        "token_ids": tokens,
        "num_prompt_tokens": len(prompt_ids),
        "num_generated_tokens": len(tokens),
        "finish_reason": reason,
        "time_s": round(elapsed, 4),
        "tokens_per_second": round(len(tokens) / elapsed, 2) if elapsed > 0 else None,
    }


def print_result(args: argparse.Namespace, result: dict, tok, streamed: bool) -> None:
    """--json: the object on stdout. Else the text (unless it was streamed already) and a summary line on stderr."""
    if args.json:
        print(json.dumps(result))
        return
    if tok is None:
        print(" ".join(map(str, result["token_ids"])), end="")
    elif not streamed:
        print(result["text"], end="")
    tau = f", tau {result['mean_acceptance_length']:.2f}" if result.get("mean_acceptance_length") else ""
    print(f"\n[{result['num_generated_tokens']} tokens, {result['tokens_per_second']} tok/s{tau}, "
          f"finish: {result['finish_reason']}]", file=sys.stderr)
    for step in result.get("steps") or []:
        print(json.dumps(step), file=sys.stderr)


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: bundled SmolLM2-135M-Instruct")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="K drafts per block for the bundled drafter (default: 4 on CPU, where K = 3-5 measure "
                        "best, see docs/perf.md; block_size - 1 elsewhere)")
    p.add_argument("--fp32-draft", action="store_true",
                   help="keep the drafter in fp32 on CPUs with bf16 units too (what CPUs without them run)")


def cmd_demo(args: argparse.Namespace) -> int:
    from blockspec.demo import run_demo

    return run_demo(args.model, args.max_tokens, args.device, args.num_draft_tokens, fp32_draft=args.fp32_draft)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="DFlash drafter; without it only the plain engine is timed")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--full-block-drafting", action="store_true", help="as in generate")
    add_speed_args(p)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true")
    from blockspec.distributed.cli import add_tp_arg

    add_tp_arg(p)


def cmd_bench(args: argparse.Namespace) -> int:
    from blockspec.evaluation.throughput import bench, synthetic_prompts
    from blockspec.loading.loader import load_model

    spec = speculative_config(args)
    if args.tensor_parallel_size > 1:
        from blockspec.distributed.cli import bench_tp

        report = bench_tp(args)
    else:
        lm = load_model(args.model, device=args.device, dtype=args.dtype, with_tokenizer=False,
                        cpu_packed=args.cpu_packed, batch_invariant=args.batch_invariant)
        draft = None
        if spec is not None:
            from blockspec.loading.draft_loader import load_draft

            draft = load_draft(spec, lm)
        prompts = synthetic_prompts(lm.config.vocab_size, args.num_prompts, args.prompt_len)
        report = bench(lm, draft, prompts, args.max_tokens, max_num_seqs=args.max_batch_size,
                       enforce_eager=args.enforce_eager)
    report["config"] = {k: getattr(args, k) for k in ("model", "draft", "num_prompts", "prompt_len", "max_tokens",
                                                      "max_batch_size", "num_draft_tokens", "full_block_drafting",
                                                      "cpu_packed", "cpu_bf16_draft", "draft_vocab_size",
                                                      "batch_invariant")}
    if args.json:
        print(json.dumps(report))
    else:
        for mode in ("plain", "spec"):
            if mode in report:
                r = report[mode]
                tau = f", tau {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else ""
                print(f"{mode:5s}: {r['generated_tokens']} tokens in {r['time_s']:.2f}s = {r['tokens_per_second']:.1f} tok/s{tau}")
        if "speedup" in report:
            print(f"speedup spec/plain: {report['speedup']:.2f}x (outputs identical: {report['outputs_identical']})")
    return 0


def add_init_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model the drafter is for (default: bundled model)")
    p.add_argument("--out", required=True, help="output directory (z-lab DFlash checkpoint format)")
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def cmd_init_draft(args: argparse.Namespace) -> int:
    from blockspec.loading.source import resolve_source
    from blockspec.models.config import ModelConfig
    from blockspec.train.export import init_draft

    src = resolve_source(args.target)
    out = init_draft(ModelConfig.from_hf(src.config, str(src.path)), args.out, args.draft_layers, args.block_size,
                     args.mask_token_id, args.seed)
    print(f"wrote a randomly initialized DFlash drafter to {out}")
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "generate": ("generate text from a prompt", add_generate_args, cmd_generate),
    "demo": ("run the bundled model on a few prompts (offline, CPU)", add_demo_args, cmd_demo),
    "bench": ("offline throughput: speculative vs plain, one run", add_bench_args, cmd_bench),
    "init-draft": ("write a randomly initialized DFlash drafter for a target", add_init_draft_args, cmd_init_draft),
}

# Subcommands that live in their own modules: name -> (help, module). The module defines `add_args(parser)` and
# `run(args) -> int`; it is imported only when its command is the one invoked, so heavy dependencies (the server
# stack, plotting) never slow down or break the other commands.
MODULE_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("OpenAI-compatible HTTP server", "blockspec.server.serve_cli"),
    "chat": ("interactive chat in the terminal, streamed", "blockspec.server.chat"),
    "draft-data": ("build drafter training data: prompts -> target-regenerated token shards", "blockspec.data.cli"),
    "eval-draft": ("a drafter's acceptance and speedup on an evaluation set (+ PNG)", "blockspec.evaluation.cli"),
    "train-draft": ("train a DFlash drafter for a target (DFlash loss, frozen target taps)", "blockspec.train.cli"),
}


def _module_command(module: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    import importlib

    mod = importlib.import_module(module)
    return mod.add_args, mod.run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="blockspec", description="DFlash speculative decoding inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {name: (add, run) for name, (_, add, run) in COMMANDS.items()}
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text))
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_text, module) in MODULE_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen module command is imported (its dependencies may be heavy)
            commands[name] = _module_command(module)
            commands[name][0](p)
    args = parser.parse_args(argv)
    try:
        return commands[args.command][1](args)
    except BlockspecError as e:
        print(f"blockspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
