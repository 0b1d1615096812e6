"""Drafter training data, prompt side: prompt readers (JSONL, ShareGPT, truncated ShareGPT, text, code) and the
shipped evaluation sets with their exclusion by content hash (building the data: test_data_builder.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import blockspec.data.prompts as prompts_mod
from blockspec.data.code_prompts import COMPLETE, SOLVE, TEMPLATES
from blockspec.data.eval_prompts import EVAL_SETS, load_eval_items, load_eval_prompts
from blockspec.data.exclusion import filter_prompts, normalized_hash
from blockspec.data.prompts import read_prompt_file, read_prompts
from blockspec.errors import BlockspecError


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "answer"},
                                  {"from": "human", "value": "follow up"}, {"from": "gpt", "value": "more"}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "a bot opens"},
                                  {"from": "human", "value": "second {[\"q\"]}"}]},
    {"id": "c", "conversations": []},
    {"id": "d", "conversations": [{"from": "human", "value": "third\nline two"}]},
]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- readers

def test_jsonl_record_kinds(tmp_path):
    rows = [
        {"prompt": "plain prompt"},
        {"instruction": "Translate", "input": "hello"},
        {"instruction": "No input", "input": ""},
        {"question": "q?"},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]},
        {"conversations": [{"from": "human", "value": "h1"}, {"from": "gpt", "value": "g"},
                           {"from": "human", "value": "h2"}]},
    ]
    f = write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in rows[:3]) + "\n\n" +
              "\n".join(json.dumps(r) for r in rows[3:]) + "\n")
    expect_all = ["plain prompt", "Translate\n\nhello", "No input", "q?", "u1", "u2", "h1", "h2"]
    assert read_prompt_file(f).prompts == expect_all
    got = read_prompt_file(f, first_turn_only=True)
    assert got.prompts == ["plain prompt", "Translate\n\nhello", "No input", "q?", "u1", "h1"]
    assert got.num_records == 6 and got.note is None


def test_sharegpt_whole_and_truncated(tmp_path, monkeypatch):
    text = json.dumps(SHAREGPT, indent=2)
    whole = write(tmp_path / "sg.json", text)
    every = ["first question", "follow up", 'second {["q"]}', "third\nline two"]
    assert read_prompt_file(whole).prompts == every
    assert read_prompt_file(whole, first_turn_only=True).prompts == [every[0], every[2], every[3]]
    # cut inside item 4 (a string value): the three whole items before it are kept, and the note says where
    cut = text.index("line two")
    trunc = write(tmp_path / "trunc.json", text[:cut])
    line4 = text[:text.index('"id": "d"')].count("\n")  # the line of item 4's opening brace (1-based)
    for chunk in (1 << 20, 5):  # the default, and tiny chunks so that every item straddles reads
        monkeypatch.setattr(prompts_mod, "_CHUNK", chunk)
        assert read_prompt_file(whole).prompts == every
        got = read_prompt_file(trunc)
        assert got.prompts == every[:3] and got.num_records == 3
        assert got.note == (f"{trunc}:{line4}: item 4 is incomplete or not valid JSON (Unterminated string starting "
                            f"at); kept the 3 whole items before it (truncated file)")
    # cut right after a whole item: no closing bracket
    between = write(tmp_path / "between.json", text[:text.index('"id": "c"')].rstrip().rstrip("{"))
    got = read_prompt_file(between)
    assert got.prompts == every[:3]
    assert got.note == f"{between}: ends after item 2 without a closing ']' (truncated file)"


def test_text_and_length_filters(tmp_path):
    f = write(tmp_path / "p.txt", "[not json] first\n\n  \nsecond line\nx\n")
    assert read_prompt_file(f).prompts == ["[not json] first", "second line", "x"]  # .txt: never parsed as JSON
    got = read_prompts([f, f], min_chars=2, max_chars=15)
    assert got.prompts == ["second line", "second line"]  # "[not json] first" is 16 chars, "x" is 1
    assert got.summary() == [{"path": str(f), "records": 3, "prompts": 1, "note": None}] * 2


def test_code_prompts(tmp_path):
    src = ('import os\n\n\ndef short(x):\n    return x\n\n\n'
           'def documented(a, b):\n    """Add two numbers."""\n    c = a + b\n    d = c * 2\n    return d - c\n\n\n'
           '@staticmethod\ndef decorated(v):\n    w = v + 1\n    w = w * 2\n    return w\n\n\n'
           'class Box:\n    def __init__(self):\n        self.v = 1\n\n    def get(self):\n        return self.v\n')
    (tmp_path / "pkg").mkdir()
    write(tmp_path / "pkg" / "m.py", src)
    write(tmp_path / "pkg" / "broken.py", "def (:\n")
    got = read_prompt_file(tmp_path / "pkg")
    assert got.num_records == 3  # short() has 2 lines: below the minimum; broken.py does not parse
    bodies = ['def documented(a, b):\n    """Add two numbers."""\n    c = a + b\n    d = c * 2\n    return d - c',
              '@staticmethod\ndef decorated(v):\n    w = v + 1\n    w = w * 2\n    return w',
              'class Box:\n    def __init__(self):\n        self.v = 1\n\n    def get(self):\n        return self.v']
    stubs = ['def documented(a, b):\n    """Add two numbers."""', None, None]  # classes get no completion stub
    assert len(got.prompts) == 3
    for body, stub, prompt in zip(bodies, stubs, got.prompts):
        allowed = {t.format(body) for t in TEMPLATES} | ({COMPLETE.format(stub), SOLVE.format(stub)} if stub else set())
        assert prompt in allowed, prompt
    assert read_prompt_file(tmp_path / "pkg").prompts == got.prompts  # deterministic


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"prompt": broken}\n', "{f}:2: invalid JSON (Expecting value); expected JSONL (one object per "
                                               "line), a JSON array, or a .txt file with one prompt per line"),
    ('{"prompt": "ok"}\n\n{"answer": "x"}\n',
     "{f}:3: no prompt field: expected one of 'prompt', 'instruction', 'question', 'problem', 'text' or a chat list "
     "in 'conversations' / 'messages'"),
    ('{"prompt": 5}\n', "{f}:1: 'prompt' must be a string, got int"),
    ('{"messages": [{"role": "user", "content": null}]}\n',
     "{f}:1: messages[0]: the user text must be a string, got None"),
    ('{"conversations": "hi"}\n', "{f}:1: 'conversations' must be a list of turns"),
    ('[{"prompt": "ok"},\n 7]', "{f}:2: item 2: expected a JSON object, got int"),
    ('[\n{"prompt": oops}, {"prompt": "x"}]', "{f}:2: item 1 is not valid JSON (Expecting value)"),
    ('', "{f}: no prompts (the file is empty)"),
])
def test_bad_prompt_files_name_file_and_line(tmp_path, content, message):
    f = write(tmp_path / "bad.jsonl", content)
    with pytest.raises(BlockspecError) as e:
        read_prompt_file(f)
    assert str(e.value) == message.format(f=f)


def test_missing_or_binary_prompt_file(tmp_path):
    with pytest.raises(BlockspecError, match=f"^prompt file {tmp_path}/nope.jsonl: no such file$"):
        read_prompt_file(tmp_path / "nope.jsonl")
    f = tmp_path / "late.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n' * 500 + b'{"prompt": "\xff"}\n')  # the bad byte is past the first read
    with pytest.raises(BlockspecError, match=f"^{f}: not UTF-8 text \\('utf-8' codec can't decode byte 0xff"):
        read_prompt_file(f)


# ---------------------------------------------------------------- evaluation sets and their exclusion

def test_eval_sets_shipped_and_formatted():
    sizes = {"humaneval": 164, "gsm8k": 1319, "math500": 500, "mbpp": 500, "mtbench": 80}
    assert set(EVAL_SETS) == set(sizes)
    for name, n in sizes.items():
        items = load_eval_items(name)
        assert len(items) == n and len({str(i.id) for i in items}) == n, name
        assert all(i.question.strip() for i in items)
    he = load_eval_items("humaneval")[0]
    assert he.id == "HumanEval/0" and he.question.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert he.prompt == ("Write a solution to the following problem and make sure that it passes the tests:\n"
                         f"```python\n{he.question}\n```")
    gsm = load_eval_items("gsm8k")[0]
    assert gsm.question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert gsm.prompt == gsm.question + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    mt = load_eval_items("mtbench")[0]
    assert mt.id == 81 and mt.prompt == mt.question and mt.other_turns[0].startswith("Rewrite your previous response.")
    assert load_eval_prompts("mbpp", 2) == [i.question for i in load_eval_items("mbpp")[:2]]
    with pytest.raises(BlockspecError, match="^unknown evaluation set 'humaneva'; choose one of humaneval, gsm8k"):
        load_eval_prompts("humaneva")


def _mangle(text: str) -> str:
    """The same text as someone might have pasted it: other case, other spacing, CRLF line ends."""
    return "  " + text.upper().replace(" ", "   ").replace("\n", "\r\n ") + "\n"


def test_training_file_loses_exactly_the_eval_prompts(tmp_path):
    gsm, he = load_eval_items("gsm8k")[5], load_eval_items("humaneval")[3]
    mt, mbpp, math = load_eval_items("mtbench")[7], load_eval_items("mbpp")[0], load_eval_items("math500")[2]
    near_miss = gsm.question.replace("?", "!?")  # one character more: a different prompt, kept
    keep = ["How do I bake bread?", "Explain TCP slow start.", near_miss, "write a haiku"]
    rows = [
        {"prompt": keep[0]},
        {"prompt": _mangle(gsm.question)},  # raw question
        {"conversations": [{"from": "human", "value": keep[1]}, {"from": "gpt", "value": "..."},
                           {"from": "human", "value": _mangle(mt.other_turns[0])}]},  # MT-Bench second turn
        {"instruction": _mangle(he.prompt)},  # formatted prompt
        {"question": near_miss},
        {"text": mbpp.question.lower() + "   "},
        {"messages": [{"role": "user", "content": _mangle(math.prompt)}]},
        {"prompt": keep[3]},
        {"prompt": "  HOW do I  bake bread?"},  # a duplicate of keep[0] after normalization
        {"prompt": _mangle(mt.question)},
    ]
    f = write(tmp_path / "train.jsonl", "\n".join(json.dumps(r) for r in rows))
    got = filter_prompts(read_prompts([f]).prompts)
    assert got.prompts == keep
    assert (got.num_excluded_eval, got.num_duplicates) == (6, 1)
    assert normalized_hash(_mangle(gsm.question)) == normalized_hash(gsm.question) != normalized_hash(near_miss)
    assert filter_prompts([gsm.question], exclude_eval=False).prompts == [gsm.question]
