"""How far the quantized CPU target (--cpu-quant q4 / q8) is from the fp32 model dequantized from the same file, on
the demo's prompts (docs/results/2026-12-05-cpu-quant-llama-cpp.md). Per mode:
  - top-1 agreement, teacher-forced: the fp32 model's greedy answer to each prompt (96 tokens) is fed through the
    quantized model, and at each answer position its argmax is compared with the token the fp32 model chose;
  - free-running: how many of the quantized model's own greedy answers equal the fp32 model's, and at which token
    the others first differ.
Usage: python tools/cpu_quant_agreement.py [--model SRC] [--max-tokens 96] [--out
docs/results/data/cpu-quant-agreement-DATE.json]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from blockspec.attention.torch_ref import attend, build_mask
from blockspec.config import EngineConfig
from blockspec.demo import DEMO_PROMPTS
from blockspec.layers import cpu_quant
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.models.base import AttentionBase
from blockspec.sampling import SamplingParams


class WholeSequence(AttentionBase):
    """Causal attention of a whole sequence over itself, in one forward (no cache)."""

    def __init__(self, n: int) -> None:
        self.mask = build_mask(torch.arange(n), torch.arange(n), causal=True)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return attend(q, k, v, self.mask, scale)


@torch.no_grad()
def argmaxes(lm: LoadedModel, ids: list[int]) -> list[int]:
    """The model's argmax after each position of `ids`, from one forward."""
    logits = lm.model(torch.tensor(ids), torch.arange(len(ids)), WholeSequence(len(ids))).logits
    return logits.argmax(-1).tolist()


def greedy(lm: LoadedModel, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = LLM.from_loaded(lm, None,
                           engine=EngineConfig(max_num_seqs=1)).generate(prompts, SamplingParams(max_tokens=max_tokens),
                                                              use_tqdm=False)
    return [o.token_ids for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct Q4_1 GGUF")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None, help="also write the result here as JSON")
    args = ap.parse_args()
    ref = load_model(args.model, LoadConfig(device="cpu"))
    prompts = [ref.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    answers = greedy(ref, prompts, args.max_tokens)
    result = {"model": ref.source.name, "prompts": len(prompts), "max_tokens": args.max_tokens, "modes": {}}
    for mode in ("q4", "q8"):
        if not cpu_quant.supported(mode, torch.device("cpu")):
            continue
        lm = load_model(args.model, LoadConfig(device="cpu", cpu_quant=mode))
        agree = total = 0
        for prompt, answer in zip(prompts, answers):
            top1 = argmaxes(lm, prompt + answer)[len(prompt) - 1:-1]  # the prediction of each answer token
            agree += sum(a == b for a, b in zip(top1, answer))
            total += len(answer)
        own = greedy(lm, prompts, args.max_tokens)
        first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
                 for o, r in zip(own, answers) if o != r]
        result["modes"][mode] = {"kernel": cpu_quant.kernel_name(mode), "top1_agreement": round(agree / total, 4),
                                 "tokens": total, "identical_answers": len(prompts) - len(first),
                                 "first_difference_at": first}
        print(f"{mode}: top-1 agreement {agree / total:.2%} over {total} tokens; {len(prompts) - len(first)} of "
              f"{len(prompts)} greedy answers identical to fp32 (others first differ at tokens {first})", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
