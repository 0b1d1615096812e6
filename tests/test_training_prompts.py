"""write_training_prompts: the prompt files the tools/prepare_*.py scripts write for drafter data."""

from __future__ import annotations

import json

from blockspec.data.eval_prompts import load_eval_items
from blockspec.data.exclusion import write_training_prompts
from blockspec.data.prompts import read_prompts


def test_written_file_drops_eval_prompts_and_duplicates_and_keeps_the_limit(tmp_path):
    he = load_eval_items("humaneval")[0]
    prompts = ["Explain TCP.", he.prompt, "explain   TCP.", "Write a poem.", "Name three rivers."]
    out = tmp_path / "p.jsonl"
    kept = write_training_prompts(out, prompts, limit=2)
    assert kept.prompts == ["Explain TCP.", "Write a poem.", "Name three rivers."]  # all kept, not only written
    assert (kept.num_excluded_eval, kept.num_duplicates) == (1, 1)
    assert kept.dropped() == "1 evaluation prompts and 1 duplicates dropped"
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"prompt": "Explain TCP."},
                                                                          {"prompt": "Write a poem."}]
    assert read_prompts([out]).prompts == ["Explain TCP.", "Write a poem."]
