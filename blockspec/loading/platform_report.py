"""The platform plan in words: `summary` (the one stderr line every command that loads a target prints) and
`explain` (`blockspec generate --explain`: what runs and why, one part a line). Only words: what runs is decided in
loading/platform.py."""

from __future__ import annotations

from blockspec.loading import platform as pf
from blockspec.loading.platform import PlatformPlan

# what each variant is, for --explain
_TARGET = {
    pf.NATIVE_STACK: "every layer in one native call per forward (blockspec/native/decoder.c), q4 weights (GGUF "
                     "Q4_1 blocks) x int8 activations",
    pf.NATIVE_Q4: "each linear on the native Q4 x Q8 kernel (blockspec/native/q4gemm.c), the layers in torch",
    pf.TORCH_INT4: "each linear on torch's int4 kernel (bf16 activations)",
    pf.NATIVE_Q8: "each linear on the native Q8 x Q8 kernel (blockspec/native/q8gemm.c), the layers in torch",
    pf.TORCH_INT8: "each linear on torch's int8 kernel (bf16 activations)",
    pf.PACKED: "every linear packed once for oneDNN in the model's dtype",
    pf.INVARIANT: "every linear on the fixed-tile Triton GEMM: a row's output does not depend on the batch",
    pf.PLAIN: "the linears as loaded (torch)",
}
_ATTENTION = {
    "torch": "the reference paged attention (torch)",
    "triton": "the Triton paged attention kernels",
    "rowwise": "the reference, each decode / verify row computed as a one-row step (the quantized kernels round "
               "activations to bf16, so rows must not depend on their batch)",
    "invariant": "the Triton kernels in their deterministic mode (fixed tiles and key splits)",
}
_DRAFTER = {
    pf.DRAFT_NATIVE: "Q8_0 linears on the native kernels, the block forward through decoder.c (blockspec/native/"
                     "draft.c)",
    pf.DRAFT_BF16: "bf16 weights packed once for oneDNN; the target verifies in its own dtype (outputs unchanged)",
    pf.DRAFT_PACKED: "packed once for oneDNN in the target's dtype",
    pf.DRAFT_PLAIN: "the drafter's layers as loaded (torch)",
    pf.DRAFT_NGRAM: "prompt lookup, no weights",
    pf.NO_DRAFTER: "plain decoding",
}


def target_text(p: PlatformPlan) -> str:
    """The target's variant in a few words, e.g. "q4 on the native stack (AVX512-VNNI)"."""
    words = {pf.NATIVE_STACK: f"q4 on the native stack ({p.native})",
             pf.NATIVE_Q4: f"q4 on native linears ({p.native})", pf.TORCH_INT4: "q4 on torch's int4 kernel", pf.NATIVE_Q8: f"q8 on native linears ({p.native})",
             pf.TORCH_INT8: "q8 on torch's int8 kernel", pf.PACKED: f"{p.dtype} oneDNN-packed",
             pf.INVARIANT: f"{p.dtype} batch-invariant"}.get(p.target, p.dtype)
    return words + (", the rest oneDNN-packed" if p.cpu_quant != "off" and p.cpu_packed else "")


def summary(p: PlatformPlan) -> str:
    """One line: "blockspec: cpu, target q4 on the native stack (AVX512-VNNI), attention rowwise, drafter native
    Q8, full-block drafting"."""
    parts = [p.device, f"target {target_text(p)}", f"attention {p.attention}",
             "no drafter" if p.drafter == pf.NO_DRAFTER else f"drafter {p.drafter}"]
    if p.full_block_drafting:
        parts.append("full-block drafting")
    if p.tensor_parallel_size > 1:
        parts.append(f"tensor parallel over {p.tensor_parallel_size} ranks")
    if not p.cuda_graphs:
        parts.append("eager (no CUDA graphs)")
    return "blockspec: " + ", ".join(parts)


def explain(p: PlatformPlan, where: str | None = None) -> str:
    """What runs and why, one part a line (`generate --explain`). where: the machine, e.g. the CPU's model."""
    rows = [("device", f"{p.device}{f' ({where})' if where else ''}, target dtype {p.dtype}"),
            ("target", f"{target_text(p)}: {_TARGET.get(p.target, p.target)}"),
            ("attention", f"{p.attention}: {_ATTENTION.get(p.attention, p.attention)}"),
            ("drafter", f"{p.drafter}{f' ({p.method})' if p.method else ''}: "
                        f"{_DRAFTER.get(p.drafter, 'a small causal LM with the target tokenizer')}")]
    if p.method == "dflash":
        rows.append(("drafting", ("full-block drafting (every block of the drafter's trained size, the first K "
                                  "drafts verified)" if p.full_block_drafting else "K + 1 rows per draft block")
                     + (", drafter in bf16" if p.cpu_bf16_draft else "")))
    rows.append(("native", {pf.NOT_USED: "not used (no --cpu-quant)", pf.NOT_BUILT: "not built"}.get(
        p.native, f"{p.native} (blockspec/native, built with the machine's C compiler)")))
    if p.tensor_parallel_size > 1:
        rows.append(("ranks", f"{p.tensor_parallel_size} (tensor parallel: rank 0 loads on the CPU and shards)"))
    width = max(len(k) for k, _ in rows)
    lines = ["platform plan:"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    if p.reasons:
        lines += ["why:"] + [f"  - {r}" for r in p.reasons]
    return "\n".join(lines)
