"""What the training prompt readers return: the prompts of one file (any kind: JSONL, JSON array, text, Python
sources) and of all the files of a run, with what the manifest reports about each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptFile:
    path: str
    prompts: list[str]
    num_records: int  # JSON objects / lines / code units read
    note: str | None = None  # why reading stopped early (truncated file), for the user and the manifest


@dataclass
class PromptSet:
    prompts: list[str]
    files: list[PromptFile] = field(default_factory=list)

    def summary(self) -> list[dict[str, Any]]:
        return [{"path": f.path, "records": f.num_records, "prompts": len(f.prompts), "note": f.note}
                for f in self.files]
