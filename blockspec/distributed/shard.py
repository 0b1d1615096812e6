"""Turn a loaded single-device target (and DFlash drafter) into this rank's shard, in place.

Modules are replaced, not rewritten: a packed qkv_proj (target's and drafter's) keeps this rank's [q_r | k_r | v_r]
rows, gate_up_proj its [gate_r | up_r] rows, o_proj / down_proj become row-parallel (all-reduce), the embedding and
lm_head vocab-parallel, and each attention module's head counts become this rank's. Hidden states, norms, the rotary
tables and the drafter's fc (it reads the replicated taps) stay replicated, so the model code runs unchanged on every
rank. A mixture-of-experts layer is split the same way inside every expert (each rank holds a slice of every expert's
intermediate channels, the router replicated, so all ranks route alike and run the same experts), and its output is
all-reduced once for the layer rather than once per expert (docs/moe.md).
The returned LoadedModel / LoadedDraft carry this rank's view of the config (its head counts), which is what the
engine sizes the KV pool shard from."""

from __future__ import annotations

import dataclasses

from torch import nn

from blockspec.distributed.layers import (AllReduceSum, HeadSplit, ParallelLMHead, RowParallelLinear,
                                          VocabParallelEmbedding, column_linear, column_qkv, head_split, input_columns,
                                          vocab_shard)
from blockspec.distributed.parallel_state import TPGroup
from blockspec.errors import ConfigError
from blockspec.layers.moe import SparseMoeBlock
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.loader import LoadedModel
from blockspec.models.dflash import DFlashAttention, DFlashDraftModel
from blockspec.models.dflash_config import DFlashConfig
from blockspec.models.decoder import MLP, Attention, DecoderForCausalLM
from blockspec.models.config import ModelConfig
from blockspec.models.qkv import LinearQKV


def check_tp_size(n: int, cfg: ModelConfig | DFlashConfig, what: str) -> None:
    """Raise ConfigError unless `n` ranks can split this model's heads and MLP (`what` names the model)."""
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % n:
        raise ConfigError(f"tensor_parallel_size={n} must divide the {what}'s num_attention_heads={heads}")
    if kv % n and n % kv:
        raise ConfigError(f"tensor_parallel_size={n} must divide the {what}'s num_key_value_heads={kv} or be a "
                          f"multiple of it (KV heads are then replicated)")
    if inter % n:
        raise ConfigError(f"tensor_parallel_size={n} must divide the {what}'s intermediate_size={inter}")
    moe_inter = getattr(cfg, "raw", {}).get("moe_intermediate_size")  # a mixture of experts' per-expert size
    if isinstance(moe_inter, int) and moe_inter % n:
        raise ConfigError(f"tensor_parallel_size={n} must divide the {what}'s moe_intermediate_size={moe_inter}")


def _shard_mlp(mlp: MLP, tp: TPGroup) -> None:
    inter = mlp.down_proj.in_features
    per = inter // tp.world_size
    start = tp.rank * per
    mlp.gate_up_proj = column_linear(mlp.gate_up_proj, [(start, per), (inter + start, per)])
    mlp.down_proj = RowParallelLinear(mlp.down_proj, start, per, tp.group)  # type: ignore[assignment]


def _shard_moe(block: SparseMoeBlock, tp: TPGroup) -> AllReduceSum:
    """Every expert keeps its slice of intermediate channels (gate|up rows, down columns: a partial sum, no
    all-reduce of its own); the block's weighted sum of them is all-reduced once."""
    for expert in block.experts:
        inter = expert.down_proj.in_features
        per = inter // tp.world_size
        start = tp.rank * per
        expert.gate_up_proj = column_linear(expert.gate_up_proj, [(start, per), (inter + start, per)])
        expert.down_proj = input_columns(expert.down_proj, start, per)
    return AllReduceSum(block, tp.group)


def _qkv_rows(s: HeadSplit, D: int, q: int, kv: int) -> list[tuple[int, int]]:
    """This rank's (start, count) rows of a packed [q | k | v] projection with q and kv rows per part."""
    return [(s.q_start * D, s.q_count * D), (q + s.kv_start * D, s.kv_count * D),
            (q + kv + s.kv_start * D, s.kv_count * D)]


def _shard_target_attention(attn: Attention, tp: TPGroup) -> None:
    s, D = head_split(attn.num_heads, attn.num_kv_heads, tp.rank, tp.world_size), attn.head_dim
    attn.qkv_proj = column_linear(attn.qkv_proj, _qkv_rows(s, D, attn.q_size, attn.kv_size))
    attn.o_proj = RowParallelLinear(attn.o_proj, s.q_start * D, s.q_count * D, tp.group)  # type: ignore[assignment]
    attn.num_heads, attn.num_kv_heads = s.q_count, s.kv_count
    attn.q_size, attn.kv_size = s.q_count * D, s.kv_count * D


def _shard_draft_attention(attn: DFlashAttention, tp: TPGroup) -> None:
    p = attn.qkv_proj
    assert isinstance(p, LinearQKV)  # LLM refuses the CPU-packed drafter with tensor parallelism
    s, D = head_split(p.num_heads, p.num_kv_heads, tp.rank, tp.world_size), p.head_dim
    attn.qkv_proj = column_qkv(p, _qkv_rows(s, D, *p.sizes[:2]), s.q_count, s.kv_count)
    attn.o_proj = RowParallelLinear(attn.o_proj, s.q_start * D, s.q_count * D, tp.group)  # type: ignore[assignment]


def rank_config(cfg, tp: TPGroup):
    """This rank's view of a model config: its own attention and KV head counts."""
    s = head_split(cfg.num_attention_heads, cfg.num_key_value_heads, tp.rank, tp.world_size)
    return dataclasses.replace(cfg, num_attention_heads=s.q_count, num_key_value_heads=s.kv_count)


def shard_target(model: DecoderForCausalLM, tp: TPGroup) -> None:
    for layer in model.layers:
        _shard_target_attention(layer.self_attn, tp)
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = _shard_moe(layer.mlp, tp)
        else:
            _shard_mlp(layer.mlp, tp)
    start, emb = vocab_shard(model.embed_tokens.weight.data, tp.rank, tp.world_size)
    emb_param = nn.Parameter(emb, requires_grad=False)
    head_param = emb_param
    if not model.config.tie_word_embeddings:
        head_param = nn.Parameter(vocab_shard(model.lm_head.weight.data, tp.rank, tp.world_size)[1], requires_grad=False)
    model.embed_tokens = VocabParallelEmbedding(emb_param, start, tp.group)  # type: ignore[assignment]
    model.lm_head = ParallelLMHead(head_param, model.config.vocab_size, tp.world_size, tp.group)  # type: ignore[assignment]
    model.config = rank_config(model.config, tp)


def shard_draft(model: DFlashDraftModel, tp: TPGroup) -> None:
    for layer in model.layers:
        _shard_draft_attention(layer.self_attn, tp)
        _shard_mlp(layer.mlp, tp)
    model.config = rank_config(model.config, tp)


def shard_pair(lm: LoadedModel, draft: LoadedDraft | None, tp: TPGroup) -> tuple[LoadedModel, LoadedDraft | None]:
    """Shard both models in place, move them to this rank's device, and return them with their rank configs."""
    shard_target(lm.model, tp)
    lm = dataclasses.replace(lm, model=lm.model.to(tp.device), config=lm.model.config)
    if draft is not None:
        shard_draft(draft.model, tp)
        draft = dataclasses.replace(draft, model=draft.model.to(tp.device), config=draft.model.config)
    return lm, draft
