"""The shipped evaluation prompt sets (blockspec/data/evalsets/, see its README for sources and licenses), formatted
the way the DFlash authors prompted them."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from blockspec.errors import BlockspecError

EVALSETS_DIR = Path(__file__).parent / "evalsets"

_REASON = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
_CODE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"

# name -> how one item's question becomes the prompt the model sees
FORMATS: dict[str, Callable[[str], str]] = {
    "humaneval": _CODE.format,
    "gsm8k": _REASON.format,
    "math500": _REASON.format,
    "mbpp": str,
    "mtbench": str,  # first turn
}
EVAL_SETS = tuple(FORMATS)


@dataclass
class EvalItem:
    id: Any  # upstream id: "HumanEval/0", 11, ...
    question: str  # the raw item text (first turn for MT-Bench)
    prompt: str  # formatted for the model
    other_turns: list[str]  # MT-Bench second turns: held out of training too, not prompted


def load_eval_items(name: str) -> list[EvalItem]:
    if name not in FORMATS:
        raise BlockspecError(f"unknown evaluation set {name!r}; choose one of {', '.join(EVAL_SETS)}")
    path = EVALSETS_DIR / f"{name}.jsonl.gz"
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
    except FileNotFoundError:
        raise BlockspecError(f"{path}: missing: the blockspec installation lacks its evaluation sets "
                             f"(package data not installed?)") from None
    fmt = FORMATS[name]
    return [EvalItem(r["id"], r["question"], fmt(r["question"]), [r["second_turn"]] if "second_turn" in r else [])
            for r in rows]


def load_eval_prompts(name: str, limit: int | None = None) -> list[str]:
    """The first `limit` (default: all) formatted prompts of an evaluation set, in upstream order."""
    if limit is not None and limit < 1:
        raise BlockspecError(f"--limit must be >= 1, got {limit}")
    return [item.prompt for item in load_eval_items(name)[:limit]]
