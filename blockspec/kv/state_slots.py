"""Recurrent-state slots of a hybrid target (models/hybrid_state.py): one per running sequence, taken when the
scheduler admits it and given back when it finishes or is preempted. Only ids are handed out here; the state itself
lives in the RecurrentState beside the KV pool, and a new owner never reads what the slot held before (its first
forward starts at position 0 from zeros)."""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(f"all {self.num_slots} recurrent-state slots are taken (one per running sequence)")
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self.free:
            raise RuntimeError(f"recurrent-state slot {slot} given back twice or never taken")
        self.free.append(slot)
