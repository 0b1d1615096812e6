"""Prepare loaded models for the platform they run on: once, at load, every projection becomes the variant this
platform runs, and no module changes shape afterwards.

Target (load_model): nn.Linear (the reference; tensor-parallel shards are cut from these by distributed/shard.py),
every linear packed for oneDNN (cpu_packed, layers/cpu_packed.py), or behind the batch-invariant GEMM
(batch_invariant, layers/invariant_linear.py). On CUDA its fused Triton prologue runs by itself (layers/kernels.py).

Drafter (load_draft): LinearQKV and nn.Linear (the reference and training; on CUDA the fused prologue runs by itself,
as the target's), or, packed for oneDNN in its own dtype or in bf16 (a packed target's drafter, cpu_bf16_draft):
PackedQKV, PackedContextKV and packed linears, its inputs cast into its dtype, and a packed copy of the target's head
where the target's own cannot serve. Argmax drafts over the first draft_vocab_size token ids get a head of their
own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.errors import BlockspecError
from blockspec.layers import cpu_packed, kernels
from blockspec.layers.cpu_packed import PackedLinear
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_io import Cast, OwnHead, VocabPrefixHead
from blockspec.models.qkv import PackedContextKV, PackedQKV


@dataclass(frozen=True)
class TargetOptions:
    """cpu_packed: every linear packed once for oneDNN (faster plain and verify steps on the CPU, same dtype; the
    model can then no longer be trained or moved). batch_invariant: every linear behind the batch-invariant GEMM,
    so with the engine's deterministic target attention greedy speculative output equals plain decoding bit for bit
    in any dtype (GPU; on CPU only under the Triton interpreter, for tests)."""

    cpu_packed: bool = False
    batch_invariant: bool = False

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Refuse what this platform cannot run, before any weight is read."""
        if self.cpu_packed:
            _check_cpu_packed(device, dtype)
        if self.batch_invariant:
            if self.cpu_packed:
                raise BlockspecError("batch_invariant=True (--batch-invariant) and cpu_packed=True (--cpu-packed) "
                                     "exclude each other")
            if not kernels.fused_device(device):
                raise BlockspecError(f"batch_invariant=True (--batch-invariant) runs Triton kernels and needs a CUDA "
                                     f"device, got {device.type!r} (fp32 on CPU is the exactness reference instead)")


def _check_cpu_packed(device: torch.device, dtype: torch.dtype) -> None:
    if not cpu_packed.fp32_supported(device):
        where = (f"the model is on {device}" if device.type != "cpu"
                 else "this torch build cannot pack linears for oneDNN (mkldnn)")
        raise BlockspecError(f"cpu_packed=True (--cpu-packed) needs a CPU with oneDNN, but {where}")
    bf16_ok = dtype == torch.bfloat16 and cpu_packed.bf16_supported(device)
    if dtype != torch.float32 and not bf16_ok:
        raise BlockspecError(f"cpu_packed=True (--cpu-packed) packs fp32 weights (bf16 on CPUs with bf16 kernels), "
                             f"not {dtype}")


def prepare_target(model: nn.Module, options: TargetOptions) -> None:
    """The target's linears in this platform's variant, in place (options checked already)."""
    if options.cpu_packed:
        cpu_packed.pack_target(model)
    if options.batch_invariant:
        from blockspec.layers.invariant_linear import make_batch_invariant  # imports triton

        make_batch_invariant(model)


def prepare_draft(model: DFlashDraftModel, lm_head: nn.Module, pack_dtype: torch.dtype | None, rows_hint: int,
                  vocab: int | None) -> None:
    """The drafter's variants, in place. lm_head: the target's. pack_dtype: pack for oneDNN in this dtype (None: the
    plain variants). rows_hint: rows of a draft block. vocab: argmax drafts over the token ids < vocab only."""
    if pack_dtype is not None:
        pack_draft(model, lm_head, pack_dtype, rows_hint, vocab)
    elif vocab is not None:
        limit_draft_vocab(model, lm_head, vocab)


@torch.no_grad()
def pack_draft(model: DFlashDraftModel, lm_head: nn.Module, dtype: torch.dtype, rows_hint: int,
               vocab: int | None = None) -> None:
    """CPU inference: weights in `dtype` with every linear packed for oneDNN, q/k/v of each layer in one GEMM, the
    context k/v of all layers in one GEMM; for the drafts a packed copy of the target's lm_head unless the head is
    already packed in `dtype` (the target keeps its head to verify), and of its first `vocab` rows for argmax drafts
    when given. The original q/k/v weights are not kept. Not undone."""
    model.to(dtype)
    attns = [layer.self_attn for layer in model.layers]
    model.context_proj = PackedContextKV([a.qkv_proj for a in attns], [a.k_norm for a in attns], dtype, rows_hint)
    for a in attns:
        a.qkv_proj = PackedQKV(a.qkv_proj, a.q_norm, a.k_norm, dtype, rows_hint)
    cpu_packed.pack_linears(model, dtype, rows_hint)  # fc, o_proj, the MLPs
    model.input_cast = Cast(dtype)
    if not (isinstance(lm_head, PackedLinear) and lm_head.dtype == dtype):  # else the target's head serves
        model.head = OwnHead(PackedLinear.from_linear(lm_head, dtype, rows_hint))
    if vocab is not None:
        model.greedy_head = OwnHead(PackedLinear(lm_head.weight[:vocab], None, dtype, rows_hint))
    else:
        model.greedy_head = model.head


def limit_draft_vocab(model: DFlashDraftModel, lm_head: nn.Module, n: int) -> None:
    """Argmax drafts over the token ids < n only (SpeculativeConfig.draft_vocab_size), through a view of the first n
    rows of the target's lm_head."""
    model.greedy_head = OwnHead(VocabPrefixHead(lm_head, n))
