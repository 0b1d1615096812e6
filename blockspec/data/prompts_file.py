"""Read `--prompts-file`: plain text (one prompt per line) or JSONL objects with "prompt" or "prompt_ids"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blockspec.data.lines import json_line, numbered_lines
from blockspec.errors import BlockspecError


@dataclass
class PromptSpec:
    prompt: str | None
    prompt_ids: list[int] | None
    max_tokens: int | None
    line: int  # 1-based line in the file, for error messages


def read_prompts_file(path: str) -> list[PromptSpec]:
    p = Path(path)
    if not p.is_file():
        raise BlockspecError(f"--prompts-file {path}: no such file")
    numbered = list(numbered_lines(path))
    jsonl = p.suffix == ".jsonl" or numbered[0][1].lstrip().startswith("{")
    if not jsonl:
        return [PromptSpec(line, None, None, n) for n, line in numbered]
    out = []
    for n, line in numbered:
        obj = json_line(path, n, line)
        if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
            raise BlockspecError(f"{path}:{n}: each line must be an object with exactly one of 'prompt' or 'prompt_ids'")
        text, ids, mt = obj.get("prompt"), obj.get("prompt_ids"), obj.get("max_tokens")
        if text is not None and not isinstance(text, str):
            raise BlockspecError(f"{path}:{n}: 'prompt' must be a string")
        if ids is not None and (not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise BlockspecError(f"{path}:{n}: 'prompt_ids' must be a non-empty list of integers")
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
            raise BlockspecError(f"{path}:{n}: 'max_tokens' must be an integer >= 1, got {mt!r}")
        out.append(PromptSpec(text, ids, mt, n))
    return out
