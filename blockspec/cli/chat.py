"""`blockspec chat`: an interactive conversation in the terminal. The engine runs in this process; replies are
streamed as they are decoded and followed by a status line (tokens, tok/s, tau, finish reason)."""

from __future__ import annotations

import argparse
import sys
import time

from blockspec.cli.flags import (add_llm_args, add_max_tokens, add_sampling_args, build_llm, report_llm,
                                 sampling_params)

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def add_args(p: argparse.ArgumentParser) -> None:
    add_llm_args(p)
    p.add_argument("--system", default=None, help="system message that opens every conversation")
    add_max_tokens(p, 512, "most tokens per reply")
    add_sampling_args(p)


def _reply(llm, prompt_ids: list[int], params) -> tuple[str, object, float]:
    """Stream one reply to stdout; returns its text, the final RequestOutput and the seconds it took."""
    from blockspec.loading.detokenizer import IncrementalDecoder

    engine, decoder = llm.engine, IncrementalDecoder(llm.tokenizer)
    rid = engine.add_request(prompt_ids, params)
    text, final, t0 = "", None, time.perf_counter()
    try:
        while final is None:
            for out in engine.step():
                piece = decoder.push(out.new_token_ids)
                text += piece
                sys.stdout.write(piece)
                sys.stdout.flush()
                if out.finished:
                    final = out
    except KeyboardInterrupt:  # stop this reply, keep the conversation
        engine.abort(rid)
        while final is None:
            final = next((o for o in engine.step() if o.finished), None)
    return text, final, time.perf_counter() - t0


def _status(final, seconds: float) -> str:
    n = len(final.token_ids)
    parts = [f"{n} tokens", f"{n / seconds:.1f} tok/s" if seconds > 0 else "-"]
    if final.mean_acceptance_length is not None:
        parts.append(f"tau {final.mean_acceptance_length:.2f}")
    return f"[{', '.join(parts)}, finish: {final.finish_reason}]"


def run(args: argparse.Namespace) -> int:
    from blockspec.errors import BlockspecError

    if args.max_tokens < 1:
        raise BlockspecError(f"--max-tokens={args.max_tokens} must be >= 1")
    sampling_params(args)  # bad values fail before the model loads
    llm = build_llm(args)
    tok = llm.tokenizer
    if tok is None or not tok.has_chat_template:
        raise BlockspecError(f"{llm.lm.source.name} has no chat template: `blockspec chat` needs a chat model")
    report_llm(llm)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    print(f"blockspec chat with {llm.lm.source.name}: {HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history = list(opening)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        ids = tok.apply_chat_template(history)
        room = llm.engine.max_model_len - len(ids)
        if room < 1:
            history.pop()
            print(f"the conversation has {len(ids)} tokens and the context is {llm.engine.max_model_len}: "
                  f"/reset to start over", file=sys.stderr)
            continue
        params = sampling_params(args, max_tokens=min(args.max_tokens, room))
        text, final, seconds = _reply(llm, ids, params)
        history.append({"role": "assistant", "content": text})
        print(file=sys.stdout, flush=True)
        print(_status(final, seconds), file=sys.stderr, flush=True)
