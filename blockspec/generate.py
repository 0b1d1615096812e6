"""Single-request reference generation over a dense KV cache: the plain autoregressive baseline and oracle."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from blockspec.attention.dense_cache import DenseCausalAttention, DenseKVCache
from blockspec.errors import BlockspecError
from blockspec.loading.loader import LoadedModel
from blockspec.sampling import SamplingParams, sample


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" | "length"
    num_prompt_tokens: int
    time_s: float
    acceptance_lengths: list[int] = field(default_factory=list)  # speculative decoding only
    steps: list[dict] = field(default_factory=list)  # speculative trace only


def check_prompt(prompt_ids: list[int], vocab_size: int, max_len: int) -> None:
    if not prompt_ids:
        raise BlockspecError("the prompt is empty: pass at least one token")
    bad = [t for t in prompt_ids if not (0 <= t < vocab_size)]
    if bad:
        raise BlockspecError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) >= max_len:
        raise BlockspecError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context is {max_len} tokens "
            f"(max_position_embeddings); shorten the prompt"
        )


def stop_set(lm: LoadedModel, params: SamplingParams) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(lm.stop_token_ids))


@torch.inference_mode()
def generate_stream(lm: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Yields generated token ids one by one; stops on a stop id (yielded) or after max_tokens."""
    cfg = lm.config
    check_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
    device = next(lm.model.parameters()).device
    max_new = min(params.max_tokens, cfg.max_position_embeddings - len(prompt_ids))
    cache = DenseKVCache.allocate(
        cfg.num_hidden_layers, len(prompt_ids) + max_new, cfg.num_key_value_heads, cfg.head_dim,
        next(lm.model.parameters()).dtype, device,
    )
    seed = params.resolve_seed()
    stops = stop_set(lm, params)
    ids = torch.tensor(prompt_ids, device=device)
    positions = torch.arange(len(prompt_ids), device=device)
    last = torch.tensor([len(prompt_ids) - 1], device=device)
    for i in range(max_new):
        attn = DenseCausalAttention(cache, positions, int(positions[-1]) + 1)
        out = lm.model(ids, positions, attn, logit_rows=last if i == 0 else None)
        token = int(sample(out.logits, params, seed, torch.tensor([len(prompt_ids) + i], device=device))[0])
        yield token
        if token in stops:
            return
        pos = len(prompt_ids) + i
        ids = torch.tensor([token], device=device)
        positions = torch.tensor([pos], device=device)


def generate(lm: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    t0 = time.perf_counter()
    tokens = list(generate_stream(lm, prompt_ids, params))
    reason = "stop" if tokens and tokens[-1] in stop_set(lm, params) else "length"
    return GenerationResult(tokens, reason, len(prompt_ids), time.perf_counter() - t0)
