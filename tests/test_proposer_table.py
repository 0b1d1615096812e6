"""tools/proposer_table.py on CPU, fp32, with a tiny random target (word-level tokenizer, chat template), a random
DFlash drafter and the target itself as its draft model (so every draft is accepted): every row of 1 dataset x 4
methods x batches 1 and 2 is measured once, through eval-draft's timing, with outputs identical to plain decoding; a
second invocation loads and times nothing; a removed row is re-measured alone; --time-budget stops before a row; bad
flags fail with one line naming the flag."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import blockspec.evaluation.throughput as throughput
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model
from tool_utils import load_tool

table = load_tool("proposer_table")
BLOCK = 4
KEYS = {"target", "dataset", "method", "batch", "tau", "tokens_per_second", "baseline_tokens_per_second", "speedup",
        "outputs_identical", "command", "prompts"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("proposer_table")
    hf = make_hf_model("qwen3", seed=12)  # vocab 128; 127 is the drafter's mask, no word of the tokenizer
    save_hf_model(hf, root / "target")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(
        "the a of to and in is def return if for print number list write python solve step answer".split())}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
                          "{% if add_generation_prompt %} answer{% endif %}")
    fast.save_pretrained(str(root / "target"))
    make_zlab_draft(hf.config, root / "dflash", block_size=BLOCK, target_layer_ids=[0, 2])
    # the draft model is the target's own weights: its greedy drafts are the target's, all accepted
    return {"target": root / "target", "dflash": root / "dflash", "small": root / "target"}


def argv(models: dict[str, Path], out: Path, *extra: str, limit: int = 2) -> list[str]:
    return ["--target", str(models["target"]), "--target-name", "tiny", "--datasets", "mbpp", "--limit", str(limit),
            "--max-tokens", "8", "--batches", "1,2", "--dflash-draft", str(models["dflash"]), "--draft-model",
            str(models["small"]), "--num-draft-tokens", "draft-model=2", "--repeats", "1", "--dtype", "float32",
            "--device", "cpu", "--out", str(out), *extra]


@pytest.fixture
def spies(monkeypatch) -> dict[str, int]:
    """Counts target loads (the tool's load_model) and timed generates (the protocol's, all modes)."""
    calls = {"loads": 0, "timed": 0}
    load, timed = table.load_model, throughput.timed_generate

    def count_load(*a, **k):
        calls["loads"] += 1
        return load(*a, **k)

    def count_timed(*a, **k):
        calls["timed"] += 1
        return timed(*a, **k)

    monkeypatch.setattr(table, "load_model", count_load)
    monkeypatch.setattr(throughput, "timed_generate", count_timed)
    return calls


def test_table_rows_resume_and_markdown(models, tmp_path, capsys, spies):
    out = tmp_path / "proposers.json"
    args = argv(models, out)
    assert table.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    # one target load; one timed run per mode and row (--repeats 1): the none rows time plain only
    assert spies == {"loads": 1, "timed": 2 * 1 + 6 * 2}
    rows = json.loads(out.read_text())
    assert [(r["method"], r["batch"]) for r in rows] == [(m, b) for m in table.METHODS for b in (1, 2)]
    for r in rows:
        assert KEYS <= set(r)
        assert (r["target"], r["dataset"], r["prompts"]) == ("tiny", "mbpp", 2)
        assert r["outputs_identical"] is True and r["command"] == shlex.join(["python", "tools/proposer_table.py",
                                                                               *args])
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / r["baseline_tokens_per_second"])
        assert r["device"] == "cpu" and r["dtype"] == "float32" and r["max_tokens"] == 8
        assert r["generated_tokens"] == r["baseline_generated_tokens"] > 0
    by = {(r["method"], r["batch"]): r for r in rows}
    assert {m: by[m, 1]["num_draft_tokens"] for m in table.METHODS} == {
        "none": 0, "ngram": 5, "draft-model": 2, "dflash": BLOCK - 1}
    for b in (1, 2):
        assert by["none", b]["tau"] == 1.0 and by["none", b]["speedup"] == 1.0
        assert by["none", b]["timing_order"] == ["plain"]
        # every method decodes the same greedy tokens as the none row's plain runs
        assert {by[m, b]["generated_tokens"] for m in table.METHODS} == {by["none", b]["generated_tokens"]}
        for m in ("ngram", "draft-model", "dflash"):
            assert by[m, b]["timing_order"] == ["plain", "spec"] and by[m, b]["tau"] >= 1.0
        assert by["draft-model", b]["tau"] > 2.0  # K = 2, every draft accepted (short of EOS or the last step)
    assert lines[0] == f"8 rows to measure; 0 already in {out}"
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 8 and progress[0].startswith("[1/8] tiny mbpp none batch 1 (2 prompts): tau 1.00, ")
    md = lines[lines.index("| target | dataset | method | batch | prompts | K | tau | tok/s | plain tok/s | speedup "
                           "| identical |"):]
    assert len(md) == 2 + 8 and md[2].startswith("| tiny | mbpp | none | 1 | 2 | - | 1.00 | ")
    assert md[-1].startswith("| tiny | mbpp | dflash | 2 | 2 | 3 | ") and md[-1].endswith("| True |")

    # again: every key is present, so nothing is loaded or timed and the file is unchanged
    before = out.read_bytes()
    spies.update(loads=0, timed=0)
    assert table.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert spies == {"loads": 0, "timed": 0} and out.read_bytes() == before
    assert lines[0] == f"0 rows to measure; 8 already in {out}" and lines[1:] == md

    # a removed row is measured again, alone
    out.write_text(json.dumps([r for r in rows if (r["method"], r["batch"]) != ("ngram", 2)]))
    assert table.main(args) == 0
    assert spies == {"loads": 1, "timed": 2}
    assert [(r["method"], r["batch"]) for r in json.loads(out.read_text())] == list(by)
    assert capsys.readouterr().out.splitlines()[0] == f"1 rows to measure; 7 already in {out}"


def test_estimate_scales_the_slowest_matching_row_of_the_target_per_prompt():
    rows = [{"target": "t", "method": "ngram", "batch": 1, "prompts": 10, "wall_s": 20.0},
            {"target": "t", "method": "none", "batch": 1, "prompts": 4, "wall_s": 12.0},
            {"target": "t", "method": "dflash", "batch": 16, "prompts": 4, "wall_s": 400.0},
            {"target": "u", "method": "dflash", "batch": 1, "prompts": 1, "wall_s": 900.0}]
    assert table.estimate(rows, "t", "ngram", 1, 5) == pytest.approx(table.SAFETY * 5 * 2.0)
    assert table.estimate(rows, "t", "dflash", 1, 5) == pytest.approx(table.SAFETY * 5 * 3.0)  # none of t at batch 1
    assert table.estimate(rows, "t", "ngram", 2, 5) is None
    assert table.estimate(rows, "v", "ngram", 1, 5) is None  # another target's rows say nothing


def test_time_budget_stops_before_a_row_that_would_pass_it(models, tmp_path, capsys, spies):
    out = tmp_path / "p.json"
    done = {"target": "tiny", "dataset": "mbpp", "method": "none", "batch": 1, "prompts": 2, "wall_s": 1000.0}
    out.write_text(json.dumps([done]))
    # --limit 1: not the done row's key, estimated from its 500 s per prompt
    assert table.main(argv(models, out, "--methods", "none", "--batches", "1", "--time-budget", "100", limit=1)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("stopped: the next row (mbpp none batch 1) needs ~625 s, 100 s of --time-budget left; 1 rows "
                        "left (run the same command again to resume)")
    assert spies == {"loads": 0, "timed": 0} and json.loads(out.read_text()) == [done]


def test_time_budget_stops_before_a_row(models, tmp_path, capsys, spies):
    out = tmp_path / "p.json"
    assert table.main(argv(models, out, "--methods", "none", "--time-budget", "0")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "stopped: --time-budget 0 s reached; 2 rows left (run the same command again to resume)"
    assert spies == {"loads": 0, "timed": 0} and not out.exists()


@pytest.mark.parametrize("extra, message", [
    (["--methods", "none,beam"], "--methods: unknown name 'beam' (choose from none, ngram, draft-model, dflash)"),
    (["--datasets", "mbpp,humaneval2"],
     "--datasets: unknown name 'humaneval2' (choose from humaneval, mbpp, gsm8k, math500, mtbench)"),
    (["--batches", "1,x"], "--batches: expected integers >= 1 separated by commas, got '1,x'"),
    (["--num-draft-tokens", "none=3"], "--num-draft-tokens: expected METHOD=K with METHOD one of ngram, draft-model, "
                                       "dflash and K >= 1, got 'none=3'"),
])
def test_bad_flags_fail_with_one_line(models, tmp_path, capsys, spies, extra, message):
    assert table.main(argv(models, tmp_path / "p.json", *extra)) == 2
    captured = capsys.readouterr()
    assert captured.err == f"proposer_table.py: error: {message}\n" and captured.out == ""
    assert spies == {"loads": 0, "timed": 0}


def test_a_method_without_its_drafter_names_the_flag(models, tmp_path, capsys):
    args = ["--target", str(models["target"]), "--methods", "none,dflash", "--out", str(tmp_path / "p.json")]
    assert table.main(args) == 2
    assert capsys.readouterr().err == ("proposer_table.py: error: --methods has dflash: pass --dflash-draft (or drop "
                                       "dflash)\n")
