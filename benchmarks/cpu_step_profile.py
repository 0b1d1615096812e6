"""Where a CPU decode step's time goes (docs/results/2026-12-05-cpu-quant-llama-cpp.md): the bundled SmolLM2 pair as
the demo sets it up, one demo
prompt decoded plainly or with DFlash, then again under torch's profiler; ms per step for the quantized matmuls,
oneDNN's packed matmuls (the drafter), SDPA, the paged KV gathers and stores, casts and copies, and every other op
(self time, so nested ops are not counted twice); the rest of the wall time is Python and the engine. Then the same
decode without the profiler, the wall time of the step's parts (the target's attention calls, MLPs and head, the
whole target forward, the proposer's draft pass) measured around them, which the profiler's per-op overhead does not
inflate. Usage: python -m benchmarks.cpu_step_profile [--threads 2] [--cpu-quant auto] [--spec] [--prompt 0]"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from blockspec.attention import paged_ref
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.demo import CPU_DRAFT_TOKENS, CPU_DRAFT_VOCAB, CPU_QUANT_DRAFT_TOKENS, DEMO_PROMPTS
from blockspec.layers import cpu_packed
from blockspec.llm import LLM
from blockspec.loading.bundled_draft import bundled_draft_path
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.loading.native_stack import NativeDraft
from blockspec.models import decoder
from blockspec.models.dflash import DFlashDraftModel
from blockspec.speculative.dflash import DFlashProposer
from blockspec.sampling import SamplingParams

PARTS = [("quantized matmuls", ("int4pack", "int8pack")), ("oneDNN packed matmuls", ("linear_pointwise",)),
         ("attention (SDPA)", ("scaled_dot_product", "flash_attention")),
         ("paged KV gather / store", ("aten::index", "index_put")),
         ("casts and copies", ("aten::to", "aten::_to_copy", "aten::copy_"))]


def part(op: str) -> str:
    """The part an op belongs to: a key naming an aten op matches it exactly, any other key is a substring."""
    for name, keys in PARTS:
        if any(op == k if k.startswith("aten::") else k in op for k in keys):
            return name
    return "other ops"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-quant", default="auto")
    ap.add_argument("--spec", action="store_true", help="DFlash with the bundled drafter (default: plain)")
    ap.add_argument("--prompt", type=int, default=0, help="index into the demo prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    lm = load_model(None, LoadConfig(device="cpu", cpu_packed=cpu_packed.fp32_supported(cpu), cpu_quant=args.cpu_quant))
    draft = None
    if args.spec:
        K = CPU_DRAFT_TOKENS if lm.cpu_quant == "off" else CPU_QUANT_DRAFT_TOKENS
        draft = load_draft(SpeculativeConfig(draft_model=str(bundled_draft_path()), num_draft_tokens=K,
                                             full_block_drafting=True, cpu_bf16_draft=cpu_packed.bf16_supported(cpu),
                                             draft_vocab_size=CPU_DRAFT_VOCAB), lm)
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=1))
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPTS[args.prompt]}])
    params = SamplingParams(max_tokens=args.max_tokens)
    llm.generate([ids], SamplingParams(max_tokens=8), use_tqdm=False)
    start = time.perf_counter()
    out = llm.generate([ids], params, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    steps = len(out.acceptance_lengths) if draft is not None else len(out.token_ids)
    print(f"cpu_quant={lm.cpu_quant} {'dflash' if draft else 'plain'}, {args.threads} thread(s): "
          f"{len(out.token_ids) / wall:.1f} tok/s, {wall / steps * 1e3:.2f} ms per step ({steps} steps)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        wall = time.perf_counter() - start
    parts: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        parts[part(e.key)] += e.self_cpu_time_total / 1e3 / steps
    for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {name:26s} {ms:6.2f} ms per step")
    ops = sum(parts.values())
    print(f"  {'all ops':26s} {ops:6.2f} ms per step; the step under the profiler {wall / steps * 1e3:.2f} ms, so "
          f"{wall / steps * 1e3 - ops:.2f} ms outside ops (Python, engine)")
    wall, times = timed_parts(llm, ids, params)
    print(f"wall time of the step's parts, no profiler ({wall / steps * 1e3:.2f} ms per step):")
    for name, seconds in times.items():
        print(f"  {name:26s} {seconds / steps * 1e3:6.2f} ms per step")
    return 0


# (part, class, method); the row-wise attention inherits __call__ (it overrides attend_sequence only)
PARTS_TIMED = [("target forward", decoder.DecoderForCausalLM, "forward"),
               ("  attention calls", paged_ref.PagedTargetAttention, "__call__"),
               ("  MLPs", decoder.MLP, "forward"),
               ("  head", decoder.DecoderForCausalLM, "compute_logits"),
               ("draft pass (propose)", DFlashProposer, "propose"),
               ("  native drafter stack", NativeDraft, "forward"),
               ("  draft head (argmax)", DFlashDraftModel, "greedy_drafts"),
               ("draft context append", DFlashProposer, "append_context")]


def timed_parts(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[float, dict[str, float]]:
    """One decode with a clock around each part of PARTS_TIMED (the methods wrapped for the run, then restored)."""
    times: dict[str, float] = defaultdict(float)
    saved = [(cls, name, cls.__dict__[name]) for _, cls, name in PARTS_TIMED]

    def clocked(part: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[part] += time.perf_counter() - start
        return run

    for part, cls, name in PARTS_TIMED:
        setattr(cls, name, clocked(part, cls.__dict__[name]))
    try:
        start = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        return time.perf_counter() - start, dict(times)
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


if __name__ == "__main__":
    raise SystemExit(main())
