"""User prompts written by the target itself, for the bundled drafter's data: the chat template is filled up to the
start of a user turn and the model samples what a user would say there (the "Magpie" way of self-prompting an
instruction-tuned model), then `blockspec draft-data` has it answer them as usual.

Why: the drafter accepts far more on held-out text like its training prompts than on the evaluation sets (walk tau
by prompt source, docs/training.md), and ShareGPT, the only real chat source here, is used up. An instruct model's
own user turns follow what its instruction tuning taught it users ask (writing, role play, coding, math, advice,
...), the kind of prompt MT-Bench and HumanEval ask. Requests that run into --max-tokens (no end of turn), very
short ones, evaluation prompts and duplicates are dropped. --user-start TEXT makes every request begin with TEXT
(e.g. "Write a Python function that") and samples the rest. Usage (GPU for tens of thousands):
  python tools/sample_user_prompts.py out.jsonl [--target SRC] [--num N] [--temperature T] [--top-p P]
      [--max-tokens N] [--seed S] [--batch N] [--user-start TEXT]"""

from __future__ import annotations

import argparse
import sys

MIN_CHARS = 12
SENTINEL = "\u2063USER\u2063"  # a string no template contains


def user_turn_prefix(tokenizer, user_start: str = "") -> list[int]:
    """Token ids of the templated conversation (default system prompt included) up to where the first user
    message's text begins, followed by user_start."""
    text = tokenizer.hf.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                            add_generation_prompt=False)
    if SENTINEL not in text:
        raise SystemExit(f"{tokenizer.source}: the chat template does not place the user's text verbatim")
    return list(tokenizer.hf.encode(text[: text.index(SENTINEL)] + user_start, add_special_tokens=False))


def sample_user_prompts(lm, num: int, *, temperature: float = 1.0, top_p: float = 0.95, max_tokens: int = 256,
                        seed: int = 0, batch: int | None = None, user_start: str = "") -> tuple[list[str], int]:
    """(the requests that ended their turn with >= MIN_CHARS characters of their own after user_start, in sampling
    order; how many ended). A turn ends at one of the model's stop tokens, as it does in chat templates whose user
    turns close with the end-of-turn token the model also emits (ChatML, Llama 3, Gemma)."""
    from blockspec.config import EngineConfig
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams

    if lm.tokenizer is None or not lm.tokenizer.has_chat_template:
        raise SystemExit(f"{lm.source.name}: a chat model with a chat template is needed")
    prefix, base = user_turn_prefix(lm.tokenizer, user_start), user_turn_prefix(lm.tokenizer)
    # the request is decoded with its given start as one text, so the tokenizer places the space between them
    start_ids = prefix[len(base):] if prefix[: len(base)] == base else lm.tokenizer.hf.encode(
        user_start, add_special_tokens=False)
    cuda = next(lm.model.parameters()).device.type == "cuda"
    batch = min(batch or (512 if cuda else 16), num)
    llm = LLM.from_loaded(lm, None,
                          engine=EngineConfig(max_num_seqs=batch,
                                              kv_cache_tokens=batch * (len(prefix) + max_tokens + 1),
                                              max_num_batched_tokens=16384 if cuda else 2048))
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=seed + i, max_tokens=max_tokens)
              for i in range(num)]
    outs = llm.generate([prefix] * num, params, use_tqdm=num > 64)
    ended = [o for o in outs if o.finish_reason == "stop"]
    long_enough = [o for o in ended if len(lm.tokenizer.decode(o.token_ids).strip()) >= MIN_CHARS]
    return [lm.tokenizer.decode(start_ids + o.token_ids).strip() for o in long_enough], len(ended)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--target", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num", type=int, default=1000, help="requests sampled (fewer are written after filtering)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=256, help="longest user request")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    p.add_argument("--batch", type=int, default=None, help="requests generated together (default 512 on CUDA, 16 "
                                                          "on CPU)")
    p.add_argument("--user-start", default="", metavar="TEXT", help="every request begins with TEXT")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    if args.num < 1 or args.max_tokens < 1:
        p.error(f"--num ({args.num}) and --max-tokens ({args.max_tokens}) must be >= 1")

    from blockspec.data.exclusion import write_training_prompts
    from blockspec.loading.loader import LoadConfig, load_model

    lm = load_model(args.target, LoadConfig(device=args.device))
    texts, ended = sample_user_prompts(lm, args.num, temperature=args.temperature, top_p=args.top_p,
                                       max_tokens=args.max_tokens, seed=args.seed, batch=args.batch,
                                       user_start=args.user_start)
    kept = write_training_prompts(args.out, texts)
    print(f"{args.num} sampled, {ended} ended their turn, {len(texts)} of >= {MIN_CHARS} characters, "
          f"{len(kept.prompts)} written to {args.out} ({kept.num_excluded_eval} evaluation prompts and "
          f"{kept.num_duplicates} duplicates dropped)", file=sys.stderr)


if __name__ == "__main__":
    main()
