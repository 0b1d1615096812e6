"""The frozen target's training forward over a packed micro-batch (whole sequences back to back), for every family:
what the plain causal pass needs besides attention masks.

- Hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet layers beside full attention, models/hybrid_state.py) keep a
  recurrent state per sequence; the packed rows are several sequences (the padding rows of a padded micro-batch one
  more), so the forward gets a RecurrentBatch that marks each sequence as its own fresh run. Every sequence starts at
  position 0, so each starts from zeros and no state is ever read back: they all write into ONE sink slot (a state
  slot of a real model is tens of MiB; one per sequence of a micro-batch would cost GiB for nothing), and the taps
  are exactly those of each sequence run alone.
- Layers that read an earlier layer's K/V instead of computing their own (Gemma 4's KV sharing) need that K/V kept
  through the forward: `shared_kv_layers` names the cache indices they read, and PackedCausalAttention keeps those.
- Sliding windows and attention sinks (gpt-oss, Gemma 4) are asked by the layers per call (train/attention.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from blockspec.models.hybrid_state import RecurrentBatch, RecurrentState
from blockspec.train.batches import MicroBatch


def shared_kv_layers(target: nn.Module) -> frozenset[int]:
    """Cache indices a later layer attends over without computing K/V of its own: Gemma 4's attention modules say
    `owns_kv` and name the cache they read `cache`; empty for families without KV sharing."""
    out: set[int] = set()
    for layer in getattr(target, "layers", ()):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and getattr(attn, "owns_kv", True) is False:
            out.add(int(attn.cache))
    return frozenset(out)


def recurrent_batch(target: nn.Module, mb: MicroBatch) -> RecurrentBatch | None:
    """A hybrid target's RecurrentBatch for `mb`: every sequence (and all padding rows together: their positions are
    0) a fresh run writing into the one sink slot; None for a target without recurrent layers."""
    shape_of = getattr(target, "recurrent_shape", None)
    if shape_of is None:
        return None
    lens = list(mb.seq_lens)
    pad = len(mb.input_ids) - sum(lens)
    if pad > 0:
        lens.append(pad)
    dev = mb.input_ids.device
    starts = torch.tensor([0, *lens]).cumsum(0)
    state = RecurrentState(shape_of(), 1, target.embed_tokens.weight.dtype, dev)
    sink = torch.zeros(len(lens), dtype=torch.long, device=dev)
    return RecurrentBatch.build(state, sink, starts.to(device=dev, dtype=torch.int32),
                                mb.positions, host_query_start=starts.tolist())


def state_kwargs(target: nn.Module, mb: MicroBatch) -> dict[str, Any]:
    """The forward's extra keyword for this target: state= for a hybrid, nothing for the others (whose forward
    takes no state)."""
    batch = recurrent_batch(target, mb)
    return {} if batch is None else {"state": batch}
