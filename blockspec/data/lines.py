"""Line-oriented prompt files (JSONL, one text prompt per line), read the same way for `generate --prompts-file`
(data/prompts_file.py) and for training prompts (data/prompts.py): UTF-8 only, blank lines skipped, line numbers
1-based and counted over every line, so that an error names file:line as an editor shows it."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from blockspec.errors import BlockspecError


@contextmanager
def utf8_text(path: str | Path) -> Iterator[None]:
    """Turn a decoding error raised while reading `path` into one line naming the file."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise BlockspecError(f"{path}: not UTF-8 text ({e})") from None


def numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of each non-blank line, streamed; raises once the file is read through
    if it had none. `path` appears in messages as given."""
    seen = False
    with utf8_text(path), open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                seen = True
                yield n, line.rstrip("\n")
    if not seen:
        raise BlockspecError(f"{path}: no prompts (the file is empty)")


def json_line(path: str | Path, n: int, line: str, expected: str = "") -> Any:
    """The JSON value on line n; `expected` (e.g. "; expected JSONL ...") is appended to the error."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise BlockspecError(f"{path}:{n}: invalid JSON ({e.msg}){expected}") from None
