"""`blockspec demo`: the README's main command. The bundled SmolLM2-135M-Instruct with the bundled DFlash drafter on a
few prompts, offline, on CPU: each answer is streamed as speculative decoding produces it, then the same prompt is
decoded without speculation, and tau, tokens/s and the speedup measured in this run are printed."""

from __future__ import annotations

import sys
import time

from blockspec.config import EngineConfig, SpeculativeConfig, default_draft_len_schedule
from blockspec.errors import ModelLoadError
from blockspec.layers import cpu_packed
from blockspec.layers.cpu_quant import kernel_name as cpu_quant_kernel
from blockspec.llm import LLM
from blockspec.loading import platform
from blockspec.loading.detokenizer import IncrementalDecoder
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.load_config import LoadConfig
from blockspec.loading.loader import LoadedModel, load_model
from blockspec.loading.platform import resolve_device
from blockspec.loading.platform_report import summary
from blockspec.sampling import SamplingParams

# The fixed drafting of the CPU kernel comparisons (tools/cpu_peer_bench.py, benchmarks/cpu_step_profile.py), which
# load the drafter directly: K = 4 on the fp32 target, 3 under --cpu-quant (torch's quantized kernels worked in
# blocks of 4 rows: docs/results/2026-12-05-cpu-quant-llama-cpp.md). The demo itself drafts as `generate --draft`.
CPU_DRAFT_TOKENS = 4
CPU_QUANT_DRAFT_TOKENS = 3
# the bundled drafter's cpu_draft_vocab_size (what the platform plan fills in): argmax drafts over the first half of
# SmolLM2's vocabulary, whose BPE ids are roughly frequency-ordered (ids below 24,576 are 98.6 % of the demo's output
# tokens), so the drafter's head pass halves. Lossless: the target verifies, only drafts of rarer ids are never made
CPU_DRAFT_VOCAB = 24576

# The three families DFlash is measured on (code, math, chat), written before any was measured, kept whatever they
# score: chat prose is where a 135M target is least predictable (per-prompt figures in
# docs/results/2026-12-03-cpu-demo-bundled-pair.md)
DEMO_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h? Explain step by step.",
    "What is 15% of 240? Show your work.",
    "Solve for x: 3x + 7 = 22. Show each step.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for writing clear code.",
    "What are the main causes of climate change?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a short poem about the ocean.",
]


def _bundled_draft(num_draft_tokens: int | None, fp32_draft: bool) -> SpeculativeConfig | None:
    """The bundled drafter with the demo's settings (the platform plan fills the rest: loading/platform.py), or None
    where it is not there (a note says so; the demo then runs plain decoding only)."""
    from blockspec.loading.bundled_draft import bundled_draft_path

    try:
        path = bundled_draft_path()
    except ModelLoadError as e:
        print(f"note: {e}\nrunning plain decoding only", file=sys.stderr)
        return None
    # fp32_draft: the drafter in fp32 on CPUs with bf16 units too; else the plan's default (bf16 where it has them)
    # the draft vocabulary on the CPU: the platform plan's, from the drafter's own cpu_draft_vocab_size
    return SpeculativeConfig(draft_model=str(path), num_draft_tokens=num_draft_tokens,
                             cpu_bf16_draft=False if fp32_draft else None)


def _load_draft(spec: SpeculativeConfig, lm: LoadedModel) -> LoadedDraft:
    from blockspec.loading.draft_loader import load_draft

    return load_draft(spec, lm)


def _stream(llm: LLM, ids: list[int], params: SamplingParams, show: bool) -> tuple[list[int], list[int], float]:
    """(tokens, acceptance lengths, seconds) of one request; its text is streamed to stdout when `show`."""
    decoder = IncrementalDecoder(llm.tokenizer)
    tokens: list[int] = []
    acc: list[int] = []
    start = time.perf_counter()
    for out in llm.stream([ids], params):
        tokens += out.new_token_ids
        if show:
            sys.stdout.write(decoder.push(out.new_token_ids))
            sys.stdout.flush()
        acc += out.new_acceptance_lengths
    return tokens, acc, time.perf_counter() - start


def run_demo(model: str | None = None, max_tokens: int = 96, device: str | None = "cpu",
             num_draft_tokens: int | None = None, fp32_draft: bool = False, cpu_quant: str = "off") -> int:
    t0 = time.perf_counter()
    dev = resolve_device(device)
    on_cpu = dev.type == "cpu"
    # on a CPU the target's linears are packed once for oneDNN (plain and spec alike): a step reads the weights
    # faster, and a verify step of K + 1 rows costs about what a 1-row step does (MKL's small GEMMs do not)
    packed = cpu_packed.fp32_supported(dev)
    load = LoadConfig(device=device, cpu_packed=packed, cpu_quant=cpu_quant if on_cpu else "off")
    # without --num-draft-tokens the demo drafts as `generate --draft` does: the step costs measured on this machine
    # (cached after the first run), K re-picked from the acceptance of the answers as they are written
    # (speculative/draft_len.py), so an answer the drafter cannot guess runs at about plain speed
    # the drafter drafts its trained block on the CPU (16 rows through a few small layers, cheap next to verifying:
    # its first drafts are accepted more often than those of a K + 1-row block), in bf16 on weights packed once for
    # oneDNN on a CPU with bf16 units (a cheaper spec step; the fp32 target verifies every draft, so the outputs stay
    # those of plain fp32 decoding): the platform plan's drafting defaults, as LLM's and the commands'
    spec = _bundled_draft(num_draft_tokens, fp32_draft) if model is None else None
    asked = platform.plan(load, spec)
    lm = load_model(model, load, asked)
    draft = _load_draft(asked.speculative, lm) if asked.speculative is not None else None
    plan = lm.plan.with_proposer(draft)
    assert lm.tokenizer is not None
    fp32 = " (fp32, oneDNN-packed)" if packed else ""
    target = f" (fp32; linears: {cpu_quant_kernel(lm.cpu_quant)})" if lm.cpu_quant != "off" else fp32
    # the drafter's dtype as set up (beside a target on the native stack the native drafter runs: the plan's line)
    bf16 = " (bf16, oneDNN-packed)" if asked.cpu_bf16_draft else fp32
    drafter = f" + the bundled DFlash drafter{bf16}" if draft else ""
    print(f"loaded {lm.source.name}{target}{drafter} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print(summary(plan), file=sys.stderr)
    plain = LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=1))
    schedule = default_draft_len_schedule(num_draft_tokens)
    spec_llm = (LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=1, draft_len_schedule=schedule))
                if draft is not None else None)
    if spec_llm is not None and spec_llm.calibration is not None:
        print(spec_llm.calibration.describe(), file=sys.stderr)
    params = SamplingParams(max_tokens=max_tokens)
    warm = lm.tokenizer.encode("Hello")
    for llm in (plain, spec_llm):  # first-call costs (allocation, kernel selection) stay out of the timings
        if llm is not None:
            _stream(llm, warm, SamplingParams(max_tokens=4), show=False)
    totals = {"spec_tokens": 0, "spec_s": 0.0, "plain_tokens": 0, "plain_s": 0.0, "acc": [], "differ": 0}
    for prompt in DEMO_PROMPTS:
        print(f"\n>>> {prompt}\n", flush=True)
        ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        if spec_llm is None:
            tokens, _, dt = _stream(plain, ids, params, show=True)
            totals["plain_tokens"] += len(tokens)
            totals["plain_s"] += dt
            print(f"\n[{len(tokens)} tokens in {dt:.2f}s, {len(tokens) / dt:.1f} tok/s]", flush=True)
            continue
        tokens, acc, dt = _stream(spec_llm, ids, params, show=True)
        ref, _, dt_plain = _stream(plain, ids, params, show=False)
        if ref != tokens:  # lossless by construction; say so loudly if it ever is not
            print("\n[warning: speculative output differs from plain decoding]", flush=True)
            totals["differ"] += 1
        tau = sum(acc) / len(acc) if acc else 1.0
        print(f"\n[spec: {len(tokens)} tokens in {dt:.2f}s = {len(tokens) / dt:.1f} tok/s, tau {tau:.2f} | "
              f"no-spec: {len(ref) / dt_plain:.1f} tok/s | speedup {dt_plain / dt:.2f}x]", flush=True)
        totals["spec_tokens"] += len(tokens)
        totals["spec_s"] += dt
        totals["plain_tokens"] += len(ref)
        totals["plain_s"] += dt_plain
        totals["acc"] += acc
    plain_rate = totals["plain_tokens"] / totals["plain_s"]
    if spec_llm is None:
        print(f"\nplain decoding: {plain_rate:.1f} tok/s overall")
        return 0
    spec_rate = totals["spec_tokens"] / totals["spec_s"]
    tau = sum(totals["acc"]) / max(1, len(totals["acc"]))
    differ = totals["differ"]
    same = f"outputs differ on {differ} of {len(DEMO_PROMPTS)} prompts" if differ else "same outputs"
    print(f"\nDFlash speculative decoding: tau {tau:.2f}, {spec_rate:.1f} tok/s vs {plain_rate:.1f} tok/s without "
          f"speculation: {totals['plain_s'] / totals['spec_s'] * totals['spec_tokens'] / totals['plain_tokens']:.2f}x "
          f"({same}, measured in this run)")
    return 0
