"""Per-request speculative decoding statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_draft_tokens: int  # K
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step (incl. correction)
    num_accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step (before stop cuts)
    num_draft_passes: int = 0
    num_verify_passes: int = 0

    def record(self, accepted: int, emitted: int) -> None:
        self.num_accepted.append(accepted)
        self.acceptance_lengths.append(emitted)
        self.num_verify_passes += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """tau: mean tokens emitted per verify step."""
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    def per_position_acceptance(self) -> list[float]:
        """Fraction of verify steps in which draft i (1..K) was accepted."""
        steps = len(self.num_accepted)
        if steps == 0:
            return [0.0] * self.num_draft_tokens
        return [sum(n >= i for n in self.num_accepted) / steps for i in range(1, self.num_draft_tokens + 1)]
