"""`blockspec generate --prompts-file`: many prompts through the batched engine, one JSON line each, in order."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from blockspec.errors import BlockspecError
from blockspec.engine.sequence import check_prompt
from blockspec.llm import LLM
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.prompts_file import read_prompts_file
from blockspec.sampling import SamplingParams


def run_prompts_file(args: argparse.Namespace, lm: LoadedModel, draft: LoadedDraft | None, params: SamplingParams) -> int:
    specs = read_prompts_file(args.prompts_file)
    tok = lm.tokenizer
    prompts, per_params = [], []
    for i, s in enumerate(specs):
        if s.prompt is not None:
            if tok is None:
                raise BlockspecError(f"{args.prompts_file}:{s.line}: the prompt is text but the model has no tokenizer; use prompt_ids")
            ids = tok.apply_chat_template([{"role": "user", "content": s.prompt}]) if args.chat else tok.encode(s.prompt)
        else:
            ids = s.prompt_ids
        try:
            check_prompt(ids, lm.config.vocab_size, lm.config.max_position_embeddings)
        except BlockspecError as e:
            raise BlockspecError(f"{args.prompts_file}:{s.line}: {e}") from None
        prompts.append(ids)
        per_params.append(dataclasses.replace(params, max_tokens=s.max_tokens) if s.max_tokens else params)
    llm = LLM.from_loaded(lm, draft, max_num_seqs=args.max_batch_size, enforce_eager=args.enforce_eager)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, per_params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - t0
    total = 0
    for ids, out in zip(prompts, outs):
        total += len(out.token_ids)
        record = {
            "text": tok.decode(out.token_ids) if tok is not None else None,
            "token_ids": out.token_ids,
            "num_prompt_tokens": len(ids),
            "num_generated_tokens": len(out.token_ids),
            "finish_reason": out.finish_reason,
            "time_s": round(elapsed, 4),  # the batch's wall time: requests ran together
            "tokens_per_second": round(len(out.token_ids) / elapsed, 2) if elapsed > 0 else None,
        }
        if draft is not None:
            record["acceptance_lengths"] = out.acceptance_lengths
            record["mean_acceptance_length"] = out.mean_acceptance_length
            if args.trace:
                record["steps"] = [s.to_dict() for s in out.steps or []]
        if args.json:
            print(json.dumps(record))
        else:
            print(f"--- prompt {len(ids)} tokens -> {len(out.token_ids)} tokens ({out.finish_reason})")
            print(record["text"] if record["text"] is not None else " ".join(map(str, out.token_ids)))
    print(f"[{len(outs)} requests, {total} tokens in {elapsed:.2f}s: {total / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0
