"""Keep evaluation prompts out of drafter training data: match prompts by a hash of their normalized text.

Normalization (lowercase, whitespace runs collapsed to one space, ends stripped) makes a copy of an evaluation prompt
that differs only in case or spacing (re-wrapped lines, trailing newline, CRLF) still match."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from blockspec.data.eval_prompts import EVAL_SETS, load_eval_items


def normalized_hash(text: str) -> str:
    return hashlib.sha256(" ".join(text.lower().split()).encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=1)
def eval_hashes() -> frozenset[str]:
    """Hashes of every shipped evaluation item: raw question, formatted prompt and MT-Bench second turns."""
    out: set[str] = set()
    for name in EVAL_SETS:
        for item in load_eval_items(name):
            out.update(normalized_hash(t) for t in (item.question, item.prompt, *item.other_turns))
    return frozenset(out)


@dataclass
class Filtered:
    prompts: list[str]  # kept, in input order
    num_excluded_eval: int  # matched an evaluation prompt
    num_duplicates: int  # repeated an earlier kept prompt (same normalized text)

    def dropped(self) -> str:
        """What the filter removed, for a summary line."""
        return f"{self.num_excluded_eval} evaluation prompts and {self.num_duplicates} duplicates dropped"


def filter_prompts(prompts: list[str], exclude_eval: bool = True, dedupe: bool = True) -> Filtered:
    banned = eval_hashes() if exclude_eval else frozenset()
    seen: set[str] = set()
    kept: list[str] = []
    excluded = duplicates = 0
    for p in prompts:
        h = normalized_hash(p)
        if h in banned:
            excluded += 1
        elif dedupe and h in seen:
            duplicates += 1
        else:
            seen.add(h)
            kept.append(p)
    return Filtered(kept, excluded, duplicates)


def write_training_prompts(path: str | Path, prompts: list[str], limit: int | None = None) -> Filtered:
    """A prompt file for drafter data: evaluation prompts and duplicates dropped (filter_prompts), then the first
    `limit` kept prompts written as JSONL lines {"prompt": ...}, the format every prompt reader here takes. Returns
    the filter's result (all kept prompts, not only those written)."""
    kept = filter_prompts(prompts)
    with open(path, "w") as f:
        for prompt in kept.prompts[:limit]:
            f.write(json.dumps({"prompt": prompt}) + "\n")
    return kept
