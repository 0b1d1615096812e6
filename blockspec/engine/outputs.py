"""The typed records the engine hands to its callers (CLI, LLM facade, server, evaluation)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    new_token_ids: list[int]  # generated since the previous output of this request
    finished: bool
    finish_reason: FinishReason | None
    acceptance_lengths: list[int]
    mean_acceptance_length: float | None
    num_preemptions: int = 0
    steps: list[StepTrace] | None = None  # per verify step: position, drafts, num_accepted
    error: str | None = None  # finish_reason ERROR: what failed in this request's own bookkeeping
