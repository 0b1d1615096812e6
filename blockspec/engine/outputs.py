"""The typed records the engine hands to its callers (CLI, LLM facade, server, evaluation).

A request's outputs are deltas: each carries what is new since the request's previous output (`new_token_ids`,
`new_acceptance_lengths`, `new_steps`), so streaming a request of L tokens copies O(L) in all instead of its whole
history at every step. Its finished output also carries the whole record (`token_ids`, `acceptance_lengths`, `steps`),
copied once. A streamed output can still read the record up to itself, but each read copies it: streaming callers
accumulate the deltas instead."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class FinishReason(str, enum.Enum):
    """Why a request stopped. A str enum: compares equal to, and JSON-encodes as, its OpenAI-style value."""

    STOP = "stop"  # a stop token (or, in the server, a stop string)
    LENGTH = "length"  # max_tokens or the context ran out
    ABORT = "abort"  # the caller aborted it
    ERROR = "error"  # its own bookkeeping failed; RequestOutput.error says how

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StepTrace:
    """One verify step of one request (`--trace`)."""

    position: int  # position of the bonus token the step verified from
    draft: list[int]  # the K drafts proposed
    num_accepted: int  # how many of them the target accepted

    def to_dict(self) -> dict:
        return {"position": self.position, "draft": list(self.draft), "num_accepted": self.num_accepted}


class Prefix(Generic[T]):
    """The first n entries of a list, held without copying it. The engine only appends to a running request's lists
    (an entry, once there, never changes), so a streamed output shares them and copies its prefix when read; a
    finished request's lists are copied once (`owned`) and read as they are."""

    __slots__ = ("_items", "_n", "_owned")

    def __init__(self, items: list[T], owned: bool = False) -> None:
        self._items, self._n, self._owned = (list(items) if owned else items), len(items), owned

    def get(self) -> list[T]:
        return self._items if self._owned else self._items[: self._n]

    def __len__(self) -> int:
        return self._n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Prefix) and self.get() == other.get()

    def __repr__(self) -> str:
        return f"Prefix(<{self._n} entries>)"


@dataclass(frozen=True)
class Record:
    """A request's whole record as of one of its outputs."""

    token_ids: Prefix[int]
    acceptance_lengths: Prefix[int]
    steps: Prefix[StepTrace]

    @classmethod
    def of(cls, token_ids: list[int], acceptance_lengths: list[int], steps: list[StepTrace], owned: bool) -> Record:
        """owned: copy the lists now (the request is finished); else share them (it runs on)."""
        return cls(Prefix(token_ids, owned), Prefix(acceptance_lengths, owned), Prefix(steps, owned))


@dataclass
class RequestOutput:
    """One output of one request: what its last engine step added, and the record so far (read on demand)."""

    request_id: str
    prompt_ids: list[int]  # the request's prompt (the engine's list, shared by its outputs, not copied)
    new_token_ids: list[int]  # generated since the previous output of this request
    finished: bool
    finish_reason: FinishReason | None
    new_acceptance_lengths: list[int]  # tokens emitted per verify step, for the steps since the previous output
    new_steps: list[StepTrace]  # those verify steps: position, drafts, num_accepted
    record: Record  # the whole record up to this output: copied once when finished, else shared
    num_preemptions: int = 0
    error: str | None = None  # finish_reason ERROR: what failed in this request's own bookkeeping

    @property
    def token_ids(self) -> list[int]:
        """All generated tokens so far (on a streamed output, copied at each read: accumulate new_token_ids)."""
        return self.record.token_ids.get()

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens emitted per verify step so far, including the correction / bonus; empty without drafting."""
        return self.record.acceptance_lengths.get()

    @property
    def steps(self) -> list[StepTrace]:
        """Every verify step so far: position, drafts, num_accepted (`--trace`)."""
        return self.record.steps.get()

    @property
    def mean_acceptance_length(self) -> float | None:
        """tau: mean tokens emitted per verify step so far; None before the first one (or without drafting)."""
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else None
