"""Code prompts from Python sources: each top-level function or class of moderate size becomes one request to explain,
review, test, complete or solve it. Cheap extra coding data for drafter training (the target writes the answers)."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from blockspec.data.prompt_set import PromptFile
from blockspec.errors import BlockspecError

MIN_LINES, MAX_LINES = 4, 80
MAX_FILES = 20_000  # a site-packages tree has far more: stop early, the prompts are plenty

_FENCE = "```python\n{}\n```"
TEMPLATES = (
    "Explain what this Python code does, step by step:\n" + _FENCE,
    "Write unit tests (pytest) for this Python code:\n" + _FENCE,
    "Review this Python code and suggest improvements:\n" + _FENCE,
)
COMPLETE = "Complete the implementation of this Python function:\n" + _FENCE
# the wording the DFlash authors give HumanEval problems (eval_prompts.py): a documented stub in that form is the
# closest training request to the evaluation's, without using its problems
SOLVE = "Write a solution to the following problem and make sure that it passes the tests:\n" + _FENCE


def source_units(source: str) -> list[tuple[str, str | None]]:
    """(source of each top-level def/class within the size limits, its signature + docstring stub for functions
    that have a docstring)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []  # not every .py file in the wild parses under this Python: skip it
    lines = source.splitlines()
    out: list[tuple[str, str | None]] = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.end_lineno is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if not MIN_LINES <= node.end_lineno - start + 1 <= MAX_LINES:
            continue
        body = "\n".join(lines[start - 1: node.end_lineno])
        stub = None
        if not isinstance(node, ast.ClassDef) and ast.get_docstring(node) and len(node.body) > 1:
            stub = "\n".join(lines[start - 1: node.body[0].end_lineno or node.lineno])
        out.append((body, stub))
    return out


def code_prompts(path: Path) -> PromptFile:
    files = sorted(path.rglob("*.py"))[:MAX_FILES] if path.is_dir() else [path]
    if not files or not files[0].exists():
        raise BlockspecError(f"{path}: no Python source files")
    prompts: list[str] = []
    units = 0
    for f in files:
        try:
            source = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for body, stub in source_units(source):
            units += 1
            # deterministic, evenly spread choice of the request kind; documented functions may also be stubs to
            # complete or solve
            kinds = TEMPLATES + ((COMPLETE, SOLVE) if stub is not None else ())
            kind = kinds[int(hashlib.sha256(body.encode()).hexdigest()[:8], 16) % len(kinds)]
            prompts.append(kind.format(stub if kind in (COMPLETE, SOLVE) else body))
    return PromptFile(str(path), prompts, units)
