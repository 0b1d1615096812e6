"""Prepare loaded models for the platform they run on: once, at load, every projection becomes the variant this
platform runs, and no module changes shape afterwards.

Target (load_model): the variant the platform plan chose (loading/platform.py): nn.Linear (the reference;
tensor-parallel shards are cut from these by distributed/shard.py), every linear packed for oneDNN (cpu_packed,
layers/cpu_packed.py), on packed int4 / int8 weights (cpu_quant, layers/cpu_quant.py), with the native layer stack
where it runs the model, or behind the batch-invariant GEMM (batch_invariant, layers/invariant_linear.py). On CUDA
its fused Triton prologue runs by itself (layers/kernels.py).

Drafter (load_draft): LinearQKV and nn.Linear (the reference and training; on CUDA the fused prologue runs by itself,
as the target's), or, packed for oneDNN in its own dtype or in bf16 (a packed target's drafter, cpu_bf16_draft):
PackedQKV, PackedContextKV and packed linears, its inputs cast into its dtype, and a packed copy of the target's head
where the target's own cannot serve. Argmax drafts over the first draft_vocab_size token ids get a head of their
own. A quantized target's drafter drafts through the target's quantized head (and a quantized copy of its first
draft_vocab_size rows); its layers stay packed in bf16 / fp32: they run 16-row blocks, where oneDNN's packed GEMMs
beat the quantized kernels, whose cost grows with every 4 rows (docs/results/2026-12-05-cpu-quant-llama-cpp.md)."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.layers import cpu_packed, cpu_quant, kernels
from blockspec.layers.cpu_packed import PackedLinear
from blockspec.layers.cpu_quant import QuantLinear
from blockspec.layers.moe import SparseMoeBlock
from blockspec.loading.platform import NATIVE_STACK, PlatformPlan
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_io import Cast, OwnHead, VocabPrefixHead
from blockspec.models.qkv import PackedContextKV, PackedQKV


def prepare_target(model: nn.Module, plan: PlatformPlan) -> PlatformPlan:
    """The target's linears in the variant `plan` chose, in place (refused combinations were refused by
    platform.plan, before any weight was read); returns the plan completed for this model (PlatformPlan.at_load:
    whether the native stack runs it; with_graphs: whether its decode step may be captured on CUDA)."""
    if plan.cpu_quant != "off":
        cpu_quant.quantize_target(model, plan.cpu_quant)
        plan = plan.at_load(model)
        if plan.target == NATIVE_STACK:
            from blockspec.loading.native_stack import attach_target

            attach_target(model)
    if plan.cpu_packed:  # after quantizing: packs the linears the quantized kernel does not take
        cpu_packed.pack_target(model)
    if kernels.fused_device(next(model.parameters()).device):  # before the batch-invariant swap takes the weights
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.stack_experts()  # the fused MoE kernel's stacked weights (layers/fused_moe.py)
    if plan.batch_invariant:
        from blockspec.layers.invariant_linear import make_batch_invariant  # imports triton

        make_batch_invariant(model)
    return plan.with_graphs(model)  # after stacking: experts the fused kernel takes are captured


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
    already packed in `dtype` or quantized (the target keeps its head to verify), and of its first `vocab` rows for
    argmax drafts when given (quantized as the target's head is, if it is). The original q/k/v weights
    are not kept. Not undone."""
    model.to(dtype)
    attns = [layer.self_attn for layer in model.layers]
    model.context_proj = PackedContextKV([a.qkv_proj for a in attns], [a.k_norm for a in attns], dtype, rows_hint)
    for a in attns:
        a.qkv_proj = PackedQKV(a.qkv_proj, a.q_norm, a.k_norm, dtype, rows_hint)
    cpu_packed.pack_linears(model, dtype, rows_hint)  # fc, o_proj, the MLPs
    model.input_cast = Cast(dtype)
    serves = isinstance(lm_head, QuantLinear) or (isinstance(lm_head, PackedLinear) and lm_head.dtype == dtype)
    if not serves:
        model.head = OwnHead(PackedLinear.from_linear(lm_head, dtype, rows_hint))
    if vocab is None:
        model.greedy_head = model.head
        return
    prefix = _quantized_prefix(lm_head, vocab)
    model.greedy_head = OwnHead(prefix if prefix is not None
                                else PackedLinear(lm_head.weight[:vocab], None, dtype, rows_hint))


def limit_draft_vocab(model: DFlashDraftModel, lm_head: nn.Module, n: int) -> None:
    """Argmax drafts over the token ids < n only (SpeculativeConfig.draft_vocab_size), through a view of the first n
    rows of the target's lm_head (a quantized copy of them when the target's head is quantized)."""
    prefix = _quantized_prefix(lm_head, n)
    model.greedy_head = OwnHead(prefix if prefix is not None else VocabPrefixHead(lm_head, n))


def _quantized_prefix(lm_head: nn.Module, n: int) -> QuantLinear | None:
    """The first n rows of a quantized target head, quantized as the head is (each row is quantized on its own, so
    these are the head's own codes), or None where the head is not quantized or the kernel does not take n rows."""
    if not isinstance(lm_head, QuantLinear) or not cpu_quant.fits(lm_head.mode, lm_head.weight[:n]):
        return None
    if isinstance(lm_head, cpu_quant.NativeQ8Linear) and n % 8 == 0 and lm_head.bias is None:
        return lm_head.rows(n)  # a view of the head's own blocks
    return cpu_quant.quantize(lm_head.mode, lm_head.weight[:n], None)
