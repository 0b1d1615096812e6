"""tools/prepare_code_stubs.py: documented stubs become HumanEval-worded requests; evaluation-set packages, test trees
and prompts used before never do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tool_utils import load_tool

FUNC = '''def {name}(x):
    """Return x doubled."""
    y = x * 2
    return y
'''


def _tree(root: Path) -> None:
    for rel, name in (("pkg/a.py", "kept_one"), ("pkg/b.py", "kept_two"), ("human_eval/c.py", "eval_pkg"),
                      ("pkg/tests/d.py", "in_tests"), ("olmo_eval/e.py", "olmo")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(FUNC.format(name=name) + "\n\ndef undocumented(x):\n    a = 1\n    b = 2\n    return a\n")


def test_stubs_skip_eval_packages_and_tests(tmp_path):
    _tree(tmp_path)
    stubs = load_tool("prepare_code_stubs").stubs(tmp_path)
    assert len(stubs) == 2
    assert all(s.startswith("Write a solution to the following problem and make sure that it passes the tests:\n```python\n")
               for s in stubs)
    assert any("def kept_one(x):\n    \"\"\"Return x doubled.\"\"\"\n```" in s for s in stubs)
    assert not any("y = x * 2" in s for s in stubs)  # the body is what the target writes, never the prompt


def test_main_excludes_prompts_used_before(tmp_path, monkeypatch, capsys):
    _tree(tmp_path / "src")
    tool = load_tool("prepare_code_stubs")
    used = tmp_path / "used.jsonl"
    first = [s for s in tool.stubs(tmp_path / "src") if "kept_one" in s]
    used.write_text(json.dumps({"prompt": first[0]}) + "\n")
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(sys, "argv", ["x", str(out), str(tmp_path / "src"), "--exclude", str(used)])
    tool.main()
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == 1 and "kept_two" in prompts[0]
    assert "1 already used" in capsys.readouterr().out
