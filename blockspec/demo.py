"""`blockspec demo`: the README's main command. Runs the bundled default model on a few prompts, offline, on CPU."""

from __future__ import annotations

import sys
import time

from blockspec.generate import generate_stream
from blockspec.loading.loader import load_model
from blockspec.sampling import SamplingParams
from blockspec.textstream import TextStreamer

DEMO_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for writing clear code.",
]


def run_demo(model: str | None = None, max_tokens: int = 96, device: str | None = "cpu") -> int:
    t0 = time.perf_counter()
    lm = load_model(model, device=device)
    print(f"loaded {lm.source.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    assert lm.tokenizer is not None
    total_tokens, total_time = 0, 0.0
    for prompt in DEMO_PROMPTS:
        print(f"\n>>> {prompt}\n", flush=True)
        ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        tokens: list[int] = []
        streamer = TextStreamer(lm.tokenizer)
        start = time.perf_counter()
        for t in generate_stream(lm, ids, SamplingParams(max_tokens=max_tokens)):
            tokens.append(t)
            sys.stdout.write(streamer.push(t))
            sys.stdout.flush()
        dt = time.perf_counter() - start
        total_tokens, total_time = total_tokens + len(tokens), total_time + dt
        print(f"\n[{len(tokens)} tokens in {dt:.2f}s, {len(tokens) / dt:.1f} tok/s]", flush=True)
    print(f"\nplain autoregressive decoding: {total_tokens / total_time:.1f} tok/s overall "
          f"(speculative decoding arrives with the bundled DFlash drafter)")
    return 0
