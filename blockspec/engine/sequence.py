"""A request's state inside the engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from blockspec.engine.outputs import FinishReason, StepTrace
from blockspec.errors import BlockspecError
from blockspec.host_tensors import host_tensor
from blockspec.sampling import SamplingParams
from blockspec.speculative.drafts import NO_DRAFTS, Drafts
from blockspec.speculative.stats import SpecStats


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: a request is its own identity. Field-by-field __eq__ made every `seq in running` / `remove(seq)` in the
# scheduler compare whole token lists (quadratic in the batch; it dominated the host time at batch 256+).
@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    max_new_tokens: int  # max_tokens capped by the model's context
    speculate: bool  # False: plain autoregressive rows for this request
    seed: int  # the request's noise key (blockspec.rng)
    stats: SpecStats
    arrival: int = 0
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens from position 0 whose target KV and draft context are in the pool
    num_hashed: int = 0  # leading blocks registered in the prefix cache
    state_slot: int = -1  # a hybrid target's recurrent-state slot while running (kv/state_slots.py); -1: none
    drafts: Drafts = NO_DRAFTS  # proposals for the tokens after the bonus (the propose stage's record)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    trace: list[StepTrace] = field(default_factory=list)
    num_streamed: int = 0  # output tokens already handed to the caller
    num_steps_streamed: int = 0  # verify steps (acceptance lengths, trace) already handed to the caller
    final_sent: bool = False
    error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_len(self) -> int:
        """Tokens that must be in the KV before decoding: the prompt, or after preemption everything but the bonus."""
        return len(self.prompt_ids) + max(0, len(self.output_ids) - 1)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len or not self.output_ids

    @property
    def bonus(self) -> int:
        return self.output_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


@dataclass
class StepResult:
    """What one engine step did for one request (the runner's answer; the engine commits it)."""

    seq: Sequence
    new_tokens: list[int]  # tokens committed this step (before stop/max_tokens cuts)
    num_accepted: int | None  # drafts accepted (verify rows only)
    num_kv_rows: int  # rows whose target KV + proposer context became valid this step
    drafts: Drafts  # the next block, proposed from the new bonus (NO_DRAFTS: none asked, or the prefill goes on)
    k: int = 0  # drafts verified this step (a prefix of seq.drafts)


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


def block_tables(seqs: list[Sequence], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] int64 block tables, padded with block 0 (read-only padding: its rows never write)."""
    tables = torch.zeros(len(seqs), max(width, 1), dtype=torch.long)
    # one tensor from the concatenated tables and one masked store: a tensor per request costs ~10 us each, which
    # is milliseconds per step at hundreds of requests
    lens = host_tensor([len(s.block_table) for s in seqs])
    tables[torch.arange(tables.shape[1]) < lens[:, None]] = host_tensor(
        list(itertools.chain.from_iterable(s.block_table for s in seqs)))
    return tables.to(device)
