"""A hybrid target's recurrent state in the engine (Qwen3.5 / Qwen3.6: Gated DeltaNet layers beside full attention;
models/hybrid_state.py holds the state and says how a verify block is rolled back).

Built beside the KV pool: one state slot per running sequence (max_num_seqs of them) plus one sink slot the decode
step's padding rows read and write, and the replay scratch of verify blocks (max_num_seqs sequences x K + 1 rows).
Both are fixed for the engine's life and allocated before the pool; their bytes are reported in engine.limits().
Prefix caching is off for hybrids (a cached block would need the recurrent state at its end, which is not kept), and
preemption is by recompute from position 0 (the slot is given back; the re-prefill starts from a zero state)."""

from __future__ import annotations

import sys
import weakref
from dataclasses import replace

import torch

from blockspec.config import EngineConfig
from blockspec.errors import ConfigError
from blockspec.models.hybrid_state import RecurrentState

PREFIX_CACHING_OFF = ("blockspec: prefix caching is off for hybrid targets: their recurrent state is not kept per "
                      "cached block")
_told: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # targets whose engine said it (LLM may build two)


def is_hybrid(model: torch.nn.Module) -> bool:
    """Whether the target keeps a recurrent state per sequence (models/qwen3_5.py: recurrent_shape)."""
    return callable(getattr(model, "recurrent_shape", None))


def recurrent_state(model: torch.nn.Module, config: EngineConfig, max_draft_len: int, dtype: torch.dtype,
                    device: torch.device) -> RecurrentState | None:
    """The state of a hybrid target's running sequences (None for a target without one): max_num_seqs slots + the
    sink, and room to keep the rows of max_num_seqs verify blocks of max_draft_len + 1 rows each."""
    if not is_hybrid(model):
        return None
    if config.tensor_parallel_size > 1:
        raise ConfigError("tensor parallelism does not support hybrid targets (linear-attention layers) yet",
                          field="tensor_parallel_size")
    keep_rows = max_draft_len + 1 if max_draft_len else 0
    return RecurrentState(model.recurrent_shape(), config.max_num_seqs + 1, dtype, device,  # type: ignore[operator]
                          config.max_num_seqs if keep_rows else 0, keep_rows)


def sink_slot(state: RecurrentState | None) -> int:
    """The slot padding rows of the decode step use (the last one; no sequence owns it)."""
    return state.num_slots - 1 if state is not None else 0


def without_prefix_caching(config: EngineConfig, model: torch.nn.Module) -> EngineConfig:
    """A hybrid target's engine config: prefix caching off, said on stderr where it was on (once per target: the
    LLM facade rebuilds its engine without the drafter when no draft length pays)."""
    if not config.enable_prefix_caching:
        return config
    if model not in _told:
        _told.add(model)
        print(PREFIX_CACHING_OFF, file=sys.stderr)
    return replace(config, enable_prefix_caching=False)
