"""Counter-based random numbers for sampling: each draw is a hash of (request seed, token position, stream, index).

Why not a torch.Generator per request: a batch of requests sampled inside one CUDA graph cannot each advance their
own generator, and a generator's state depends on how many draws came before, so plain and speculative decoding
would consume it differently. A hash of a counter has no state. The noise used for the token at position p of a
request is the same whichever step, batch, path or device samples it, so
  - a seeded request is reproducible, and its noise does not depend on what else is in the batch (its logits can,
    at rounding level, on GPU: split-K attention chunks keys by batch size, as in other engines);
  - speculative decoding with argmax drafts emits exactly the tokens plain decoding samples with the same seed
    (every emitted token is the target's sample at its position, from the same prefix and the same noise).
Reusing a position's noise after a rejected verify step stays exact: the rejection was decided by noise at earlier
positions only, so the noise at p is still independent of the (new) prefix it is used with.

The hash is murmur3's 32-bit finalizer applied twice, on int64 tensors holding uint32 values (int64 products wrap
mod 2^64, which keeps the low 32 bits right on every device)."""

from __future__ import annotations

import torch

STREAM_TARGET = 0  # the target's sample at a position (plain decoding, verify rows, prefill's first token)
STREAM_DRAFT = 1  # probabilistic drafting: the draft's sample
STREAM_ACCEPT = 2  # probabilistic drafting: the acceptance test's uniform
# probabilistic drafting: the sample from the residual distribution after a rejection (or the bonus after full
# acceptance). Keyed by the block's start (the bonus position), not the sampled position: it is drawn once per
# verify step and every step has its own start, so it is never reused.
STREAM_RESIDUAL = 3
STREAM_BENCH = 4  # benchmark-only forced acceptance (blockspec.speculative.acceptance.ForcedAcceptance)

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds, positions [N] int64 -> two 32-bit keys per row."""
    ctr = _fmix32(((positions.long() & 0x3FFFFFFF) * 4 + stream) & _MASK32)
    lo = _fmix32((seeds & _MASK32) ^ ctr)
    hi = _fmix32(((seeds >> 32) & _MASK32) ^ _fmix32((lo + _GOLDEN) & _MASK32))
    return lo, hi


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """[N, width] float32 uniforms in the open interval (0, 1) (24 bits each)."""
    lo, hi = _row_keys(seeds, positions, stream)
    col = (torch.arange(width, device=seeds.device, dtype=torch.int64) * _GOLDEN) & _MASK32
    h = _fmix32((col[None, :] + lo[:, None]) & _MASK32)
    h = _fmix32(h ^ hi[:, None])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def exponential(seeds: torch.Tensor, positions: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """[N, width] float32 Exp(1) draws, strictly positive."""
    return -torch.log(uniform(seeds, positions, stream, width))
