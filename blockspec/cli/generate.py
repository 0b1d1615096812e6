"""`blockspec generate`: one prompt (--prompt, --prompt-ids) streamed through the engine, or many (--prompts-file)
through the batched engine, one JSON line each, in order (--tensor-parallel-size N: served by N ranks); --explain:
what runs the target and drafter on this machine, and why (the platform plan), without generating."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import TYPE_CHECKING

from blockspec.cli.flags import (add_device_args, add_engine_args, add_max_batch_size, add_max_tokens, add_model_arg,
                                 add_sampling_args, add_speculative_args, add_speed_args, engine_config, load_config,
                                 report_llm, sampling_params, speculative_config)
from blockspec.config import EngineConfig, default_draft_len_schedule
from blockspec.errors import BlockspecError

# KV slots of a one-prompt engine with a drafter: room for the calibration's acceptance prompts
CALIBRATION_KV_TOKENS = 1024

# the engine, the loaders and torch are imported by run(): `generate --help` and a bad flag need none of them
if TYPE_CHECKING:
    from blockspec.engine.outputs import RequestOutput
    from blockspec.llm import LLM, Models
    from blockspec.sampling import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts-file",
                     help="many prompts: text (one per line) or JSONL with prompt/prompt_ids[/max_tokens]")
    src.add_argument("--explain", action="store_true",
                     help="print what runs the target and the drafter on this machine, and why (loads them), then "
                          "exit without generating")
    add_max_batch_size(p, 32, "most requests decoded together (--prompts-file)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    add_max_tokens(p, 128)
    add_sampling_args(p)
    add_device_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")
    add_speculative_args(p)
    add_speed_args(p)
    p.add_argument("--trace", action="store_true", help="report every step's drafts and number accepted")
    add_engine_args(p, ["enforce_eager", "overlap", "tensor_parallel_size", "draft_len_schedule"])


def run(args: argparse.Namespace) -> int:
    from blockspec.engine.sequence import check_prompt
    from blockspec.llm import LLM, load_models
    from blockspec.loading.detokenizer import IncrementalDecoder

    params = sampling_params(args)
    spec = speculative_config(args, report_flags=["trace"])
    given = engine_config(args)
    models = load_models(args.model, load_config(args), spec, given.get("tensor_parallel_size", 1))
    if args.explain:
        return _explain(models)
    if args.prompts_file is not None:
        return _run_prompts_file(args, models, params)
    lm, tok = models.lm, models.lm.tokenizer
    prompt_ids = _prompt(args, tok, lm.source.name)
    check_prompt(prompt_ids, lm.config.vocab_size, lm.config.max_position_embeddings)  # before the engine is built
    # one request through the batched engine (the same step, and on CUDA the same graphs, as every other path), with
    # a KV pool just large enough for it, or for the draft length calibration's requests (engine/calibrate.py)
    K = models.num_draft_tokens
    cap = min(len(prompt_ids) + params.max_tokens, lm.config.max_position_embeddings) + K + 1
    if models.draft is not None:
        cap = max(cap, CALIBRATION_KV_TOKENS)
    one_request = ("enforce_eager", "tensor_parallel_size", "overlap")  # the engine flags one request can use
    engine = EngineConfig(**{k: v for k, v in given.items() if k in one_request},
                          **_schedule(args), max_num_seqs=1)
    engine = dataclasses.replace(engine, num_kv_blocks=max(2, -(-cap // engine.block_size) + 1))
    llm = LLM.from_loaded(lm, models.draft, engine=engine, sources=models.sources)
    report_llm(llm)
    warm = llm.warm_up(prompt_ids, params)  # CUDA graphs and kernel compiles, outside the timed decode
    if warm:
        print(f"warm-up (CUDA graphs, kernel compiles): {warm:.1f}s", file=sys.stderr)
    decoder = IncrementalDecoder(tok) if tok is not None and not args.json else None
    try:
        t0 = time.perf_counter()
        final, first = None, None
        for final in llm.stream([prompt_ids], params):
            if first is None and final.new_token_ids:
                first = time.perf_counter()
            if decoder is not None:
                sys.stdout.write(decoder.push(final.new_token_ids))
                sys.stdout.flush()
        end = time.perf_counter()
    finally:
        llm.close()
    result = _result(tok, prompt_ids, final, end - t0, llm, args.trace)
    if first is not None and len(final.token_ids) > 1 and end > first:
        # the decode rate: tokens after the first over the time after it (the prompt's prefill stays out)
        result["time_to_first_token_s"] = round(first - t0, 4)
        result["tokens_per_second"] = round((len(final.token_ids) - 1) / (end - first), 2)
    _print_result(args, result, tok, streamed=decoder is not None)
    return 0


def _explain(models: Models) -> int:
    """--explain: the platform plan, what runs and why, on stdout."""
    import torch

    from blockspec.loading.platform import cpu_model
    from blockspec.loading.platform_report import explain

    plan = models.plan
    where = torch.cuda.get_device_name(plan.device) if plan.device.startswith("cuda") else cpu_model()
    print(explain(plan, where))
    return 0


def _run_prompts_file(args: argparse.Namespace, models: Models, params: SamplingParams) -> int:
    from blockspec.data.prompts_file import read_prompts_file
    from blockspec.engine.sequence import check_prompt
    from blockspec.llm import LLM

    lm, tok = models.lm, models.lm.tokenizer
    prompts, per_params = [], []
    for s in read_prompts_file(args.prompts_file):
        if s.prompt is not None:
            if tok is None:
                raise BlockspecError(f"{args.prompts_file}:{s.line}: the prompt is text but the model has no "
                                     f"tokenizer; use prompt_ids")
            ids = _encode(tok, s.prompt, args.chat)
        else:
            ids = s.prompt_ids
        try:
            check_prompt(ids, lm.config.vocab_size, lm.config.max_position_embeddings)
        except BlockspecError as e:
            raise BlockspecError(f"{args.prompts_file}:{s.line}: {e}") from None
        prompts.append(ids)
        per_params.append(dataclasses.replace(params, max_tokens=s.max_tokens) if s.max_tokens else params)
    llm = LLM.from_loaded(lm, models.draft, engine=EngineConfig(**{**_schedule(args), **engine_config(args)}),
                          sources=models.sources)
    report_llm(llm)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, per_params, use_tqdm=not args.json)
        elapsed = time.perf_counter() - t0
    finally:
        llm.close()
    for ids, out in zip(prompts, outs):
        # time_s is the batch's wall time: the requests ran together
        record = _result(tok, ids, out, elapsed, llm, args.trace)
        if args.json:
            print(json.dumps(record))
        else:
            print(f"--- prompt {len(ids)} tokens -> {len(out.token_ids)} tokens ({out.finish_reason})")
            print(record["text"] if record["text"] is not None else " ".join(map(str, out.token_ids)))
    total = sum(len(o.token_ids) for o in outs)
    print(f"[{len(outs)} requests, {total} tokens in {elapsed:.2f}s: {total / max(elapsed, 1e-9):.1f} tok/s]",
          file=sys.stderr)
    return 0


def _schedule(args: argparse.Namespace) -> dict:
    """The draft length schedule asked (--draft-len-schedule); by default K throughout where --num-draft-tokens is
    given, else measured on this machine."""
    default = default_draft_len_schedule(getattr(args, "num_draft_tokens", None))
    return {"draft_len_schedule": engine_config(args).get("draft_len_schedule", default)}


def _prompt(args: argparse.Namespace, tok, model_name: str) -> list[int]:
    """The prompt token ids of --prompt-ids, or of --prompt (with --chat: in the chat template)."""
    if args.prompt_ids is not None:
        if args.chat:
            raise BlockspecError("--chat needs --prompt text, not --prompt-ids")
        try:
            return [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t != ""]
        except ValueError:
            raise BlockspecError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if tok is None:
        raise BlockspecError(f"{model_name} has no tokenizer: pass --prompt-ids instead of --prompt")
    return _encode(tok, args.prompt, args.chat)


def _encode(tok, text: str, chat: bool) -> list[int]:
    """The token ids of `text`; `chat`: as a user turn in the model's chat template."""
    return tok.apply_chat_template([{"role": "user", "content": text}]) if chat else tok.encode(text)


def _result(tok, prompt_ids: list[int], out: RequestOutput, elapsed: float, llm: LLM, trace: bool = False) -> dict:
    """One request's `generate --json` object; with a drafter also its acceptance lengths, the draft length schedule
    it ran with (`trace`: and its steps), or the all-zero schedule for which it was left out."""
    tokens = out.token_ids
    result = {
        "text": tok.decode(tokens) if tok is not None else None,
        "token_ids": tokens,
        "num_prompt_tokens": len(prompt_ids),
        "num_generated_tokens": len(tokens),
        "finish_reason": out.finish_reason,
        "time_s": round(elapsed, 4),
        "tokens_per_second": round(len(tokens) / elapsed, 2) if elapsed > 0 else None,
    }
    if llm.plan.tensor_parallel_size > 1:
        result["tensor_parallel_size"] = llm.plan.tensor_parallel_size
    if llm.engine.proposer is not None:
        result["acceptance_lengths"] = out.acceptance_lengths
        result["mean_acceptance_length"] = out.mean_acceptance_length
        result["draft_len_schedule"] = llm.engine.config.draft_len_schedule
        result["draft_lens_used"] = dict(sorted(llm.engine.draft_len.used.items()))  # K -> steps, this run
        if trace:
            result["steps"] = [s.to_dict() for s in out.steps or []]
    elif llm.calibration is not None and llm.calibration.drafts_nothing:  # --draft given, the calibration dropped it
        result["mean_acceptance_length"] = 1.0  # one token a step, as plain decoding
        result["draft_len_schedule"] = llm.calibration.schedule
    return result


def _print_result(args: argparse.Namespace, result: dict, tok, streamed: bool) -> None:
    """--json: the object on stdout. Else the text (unless it was streamed already) and a summary line on stderr."""
    if args.json:
        print(json.dumps(result))
        return
    if tok is None:
        print(" ".join(map(str, result["token_ids"])), end="")
    elif not streamed:
        print(result["text"], end="")
    tau = f", tau {result['mean_acceptance_length']:.2f}" if result.get("mean_acceptance_length") else ""
    used = result.get("draft_lens_used")
    ks = f", K used (K:steps) {', '.join(f'{k}:{n}' for k, n in used.items())}" if used else ""
    ttft = result.get("time_to_first_token_s")
    rate = f"{result['tokens_per_second']} tok/s" + (f" decoding, first token after {ttft:.3f}s" if ttft else "")
    print(f"\n[{result['num_generated_tokens']} tokens, {rate}{tau}{ks}, finish: {result['finish_reason']}]",
          file=sys.stderr)
    for step in result.get("steps") or []:
        print(json.dumps(step), file=sys.stderr)
