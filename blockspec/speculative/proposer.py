"""The Proposer seam: what a speculative method must provide to the engine's step (implementations are listed in
blockspec/speculative/registry.py).

A step is verify -> accept -> append context -> propose (blockspec/speculative/step.py). The target's verify and
the acceptance are the same for every method; a proposer supplies the two stages around them:
  append_context(models, rows)   after acceptance: learn the committed rows (their target taps, tokens, slots)
  propose(models, batch)         the next K drafts of every request, from its new bonus token
Both are device-only and shape-static given (B, K), so the decode step captures them inside its CUDA graph. Every stage
runs on a StepModels record: the target, the proposer (None: plain decoding), the paged pool, the attention backend,
and a hybrid target's recurrent state (models/hybrid_state.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
import torch

from blockspec.attention.backends import AttentionBackend
from blockspec.attention.paged_ref import PagedBatch
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.models.hybrid_state import RecurrentState
from blockspec.sampling import SamplingRows


@dataclass
class StepModels:
    target: torch.nn.Module  # the target model (models/decoder.py): forward, embed_tokens, lm_head
    proposer: Proposer | None  # None: plain decoding
    pool: KVPool
    backend: AttentionBackend
    state: RecurrentState | None = None  # a hybrid target's per-sequence state slots (None: the target keeps none)

    @property
    def tap_layers(self) -> list[int]:
        return self.proposer.tap_layers if self.proposer is not None else []


@dataclass
class CommittedRows:
    """The rows of a verify forward, with the slots of those whose tokens were committed (-1: rejected or padding).
    A proposer with its own cache writes the committed rows' entries at those slots."""

    token_ids: torch.Tensor  # [N] int64
    batch: PagedBatch  # the verify forward's attention metadata (positions [N], query_start, kv_lens, block_tables)
    slots: torch.Tensor  # [N] int64, -1 where the row is not committed
    taps: torch.Tensor | None  # [N, len(tap_layers) * H] the target's tapped residual streams (None: no taps asked)
    # whether the step proposes after this append (False: every request of it drafts nothing next, K' = 0); a
    # proposer may then keep the rows and append them before its next propose (DFlash on the CPU)
    propose_next: bool = True


@dataclass
class DraftBatch:
    """B requests to draft for, each from its bonus token; rows are laid out `rows` apart (padded, never ragged)."""

    bonus: torch.Tensor  # [B] int64 the last committed token (not yet in the KV)
    start: torch.Tensor  # [B] int64 its position (= tokens already in the KV)
    block_tables: torch.Tensor  # [B, W] int64
    query_start: torch.Tensor  # [B+1] int32, `rows` apart
    num_draft_tokens: int  # K
    rows: int  # rows of one request's draft block (Proposer.draft_rows(K))
    max_kv_len: int | None = None  # host bound for the reference attention (None inside captured steps)
    sampling: SamplingRows | None = None  # the requests' sampling rows, given when sampled drafts are asked for


@dataclass
class Proposal:
    drafts: torch.Tensor  # [B, K] int64 argmax drafts
    logits: torch.Tensor | None = None  # [B, K, V] fp32 draft logits (asked for by probabilistic drafting)
    # [B, K, V] fp32: drafts the proposer sampled itself (from batch.sampling) and the distributions q they were
    # drawn from (DFlash 2's selector: each draft conditions the next); None: the engine draws from `logits`
    q: torch.Tensor | None = None


class Proposer(ABC):
    name: str
    tap_layers: list[int]  # target layers whose residual streams append_context needs ([] = none)
    cache_shape: CacheShape | None  # its own K/V in the pool, under the target's block tables (None: none)
    cache_dtype: torch.dtype | None
    num_draft_tokens: int  # the K it was configured for (the most any step asks)
    probabilistic: bool  # drafts are sampled from its distribution (p/q rejection) instead of argmax

    def bind(self, pool: KVPool) -> None:
        """Allocate any per-slot state of its own besides the pool's proposer pages (called once, by the engine)."""

    def draft_rows(self, K: int) -> int:
        """Rows of one request's draft block when it proposes K drafts."""
        return K + 1

    def default_draft_len_schedule(self, device: torch.device) -> dict[int, int] | None:
        """K by batch size measured for this proposer on `device` (speculative/schedule.py), or None: the engine's
        default when it is given none."""
        return None

    def recorded_step_ms(self, device: torch.device) -> dict[int, dict[int, float]] | None:
        """The step costs ({batch: {K: ms}}) measured with that schedule on `device`, or None."""
        return None

    def recorded_acceptance(self) -> list[float] | None:
        """p_1..p_K (the share of verify steps accepting draft i) recorded with the proposer, or None: calibration
        measures it (engine/calibrate.py)."""
        return None

    def identity(self) -> dict:
        """What a step's cost depends on besides the target: calibrations are cached under it."""
        return {"method": self.name, "K": self.num_draft_tokens, "probabilistic": self.probabilistic,
                "rows": self.draft_rows(self.num_draft_tokens)}

    @abstractmethod
    def append_context(self, models: StepModels, rows: CommittedRows) -> None: ...

    @abstractmethod
    def propose(self, models: StepModels, batch: DraftBatch, want_logits: bool = False) -> Proposal: ...

