"""What an engine tells the code around it (the server, metrics, the commands) without handing out its parts: its
fixed limits and its state between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockspec.loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineLimits:
    """Fixed for the engine's life."""

    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int  # the context a request may fill (prompt + completion)
    num_kv_blocks: int
    kv_capacity: int  # tokens the KV pool holds (num_kv_blocks x block_size)
    max_draft_tokens: int  # K: the most drafts one step verifies per request (0: plain decoding)
    # a hybrid target's recurrent state: max_num_seqs slots + the decode step's sink + the verify blocks' replay
    # scratch, allocated with the engine beside the KV pool (0: a target without one)
    recurrent_state_bytes: int = 0


@dataclass(frozen=True)
class EngineStats:
    """The engine between two steps."""

    waiting: int  # requests not yet admitted
    running: int  # requests admitted (prefilling or decoding)
    kv_blocks_used: int  # KV blocks held by requests or cached prefixes in use
    num_overlapped_steps: int  # steps enqueued before the previous one's tokens were read (overlap)
    num_decode_steps: int = 0  # steps run on the decode step (engine/decode_step.py), chained ones included
    num_varlen_steps: int = 0  # steps (or the part of a mixed step) run on the varlen path
    cuda_graphs: tuple[CapturedGraph, ...] = ()  # the decode steps captured so far (none on the CPU or eager)


@dataclass(frozen=True)
class CapturedGraph:
    """One captured decode step: one CUDA graph per (bucket, K, K', sampling mode)."""

    batch: int  # the bucket: requests padded up to it
    k: int  # drafts verified per request
    next_k: int  # drafts proposed per request (K')
    all_greedy: bool  # False: a graph of rows that sample
