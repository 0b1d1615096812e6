"""`blockspec generate --prompts-file`: many prompts through the batched engine, one JSON object per prompt in input
order, with the fields of the single-prompt form and the same token ids (and acceptance lengths with --draft) as
running each prompt alone; bad files exit 2 with one line naming file:line. Driven in-process through
blockspec.cli.main with capsys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from blockspec.cli import main
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model

VOCAB = 128
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "big", "red", "house", "and", "then", "it",
         "was", "very", "small", "green", "tree"]


def save_word_tokenizer(path: Path) -> None:
    """A tiny word-level tokenizer (ids 0..2 special, then the words, then filler) as tokenizer.json +
    tokenizer_config.json, loadable by AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS + [f"w{i}" for i in range(VOCAB - 3 - len(WORDS))]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        str(path))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(target with a tokenizer or None, the same target without one, a DFlash drafter for it)."""
    root = tmp_path_factory.mktemp("prompts_file")
    hf = make_hf_model("llama", seed=7, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    bare = save_hf_model(hf, root / "bare")
    make_zlab_draft(hf.config, root / "draft", layers=1, block_size=4, target_layer_ids=[0, 1], mask_token_id=127)
    withtok = Path(shutil.copytree(bare, root / "withtok"))
    try:
        save_word_tokenizer(withtok)
    except ImportError:  # no tokenizers/transformers tokenizer classes: text prompts are skipped
        withtok = None
    return withtok, bare, root / "draft"


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["generate", "--device", "cpu", "--draft-len-schedule", "off", *args])  # K throughout
    out, err = capsys.readouterr()
    return rc, out, err


_single: dict = {}


def single(capsys, model, *args: str) -> dict:
    """The single-prompt form's JSON record (memoized)."""
    key = (str(model), args)
    if key not in _single:
        rc, out, err = run(capsys, "--model", str(model), "--json", *args)
        assert rc == 0, err
        lines = out.strip().splitlines()
        assert len(lines) == 1
        _single[key] = json.loads(lines[0])
    return _single[key]


def batch(capsys, model, path, *args: str) -> list[dict]:
    rc, out, err = run(capsys, "--model", str(model), "--prompts-file", str(path), "--json", *args)
    assert rc == 0, err
    assert "Traceback" not in err
    return [json.loads(line) for line in out.strip().splitlines()]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


VOLATILE = ("time_s", "tokens_per_second")
# a single prompt's decode timing and the K its engine ran (a file's requests share one engine and one timing)
RUN_ONLY = ("time_to_first_token_s", "draft_lens_used")


def same_record(got: dict, want: dict) -> None:
    got, want = ({k: v for k, v in r.items() if k not in RUN_ONLY} for r in (got, want))
    assert set(got) == set(want), (sorted(got), sorted(want))
    assert {k: v for k, v in got.items() if k not in VOLATILE} == {k: v for k, v in want.items() if k not in VOLATILE}
    assert isinstance(got["time_s"], float) and got["time_s"] >= 0
    assert got["tokens_per_second"] is None or got["tokens_per_second"] >= 0


ID_PROMPTS = [[5], [9, 8, 7, 6, 5, 4, 3], list(range(10, 60)), [100, 3], list(range(3, 120, 2)), [42] * 20]


# --------------------------------------------------------------------------------------------------------------
# good files


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "dflash"])
def test_jsonl_prompt_ids_match_single_prompt_runs(capsys, dirs, tmp_path, draft):
    _, bare, draft_dir = dirs
    # K throughout: a calibration that picks K = 0 everywhere on some machine would leave the drafter out
    extra = ("--draft", str(draft_dir), "--draft-len-schedule", "off") if draft else ()
    lines = [{"prompt_ids": p} if i % 2 else {"prompt_ids": p, "max_tokens": 3 + i} for i, p in enumerate(ID_PROMPTS)]
    f = write(tmp_path / "prompts.jsonl", lines)
    got = batch(capsys, bare, f, "--max-tokens", "9", *extra)
    assert len(got) == len(ID_PROMPTS)
    for line, rec in zip(lines, got):  # input order, whatever order they finished in
        mt = str(line.get("max_tokens", 9))
        want = single(capsys, bare, "--prompt-ids", ",".join(map(str, line["prompt_ids"])), "--max-tokens", mt, *extra)
        same_record(rec, want)
        assert rec["text"] is None  # no tokenizer in this directory
        assert rec["num_prompt_tokens"] == len(line["prompt_ids"])
        assert rec["num_generated_tokens"] == len(rec["token_ids"]) <= int(mt)
        if draft:
            assert "acceptance_lengths" in rec and sum(rec["acceptance_lengths"]) == len(rec["token_ids"]) - 1
        else:
            assert "acceptance_lengths" not in rec and "mean_acceptance_length" not in rec


def test_trace_and_small_batch_size(capsys, dirs, tmp_path):
    """--trace adds the steps, like the single-prompt form; --max-batch-size 2 queues the rest, same results."""
    _, bare, draft_dir = dirs
    f = write(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in ID_PROMPTS])
    args = ("--max-tokens", "7", "--draft", str(draft_dir), "--trace", "--draft-len-schedule", "off")
    got = batch(capsys, bare, f, "--max-batch-size", "2", *args)
    for p, rec in zip(ID_PROMPTS, got):
        want = single(capsys, bare, "--prompt-ids", ",".join(map(str, p)), *args)
        same_record(rec, want)
        assert len(rec["steps"]) == len(rec["acceptance_lengths"])


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "dflash"])
def test_seeded_sampling_matches_single_prompt_runs(capsys, dirs, tmp_path, draft):
    _, bare, draft_dir = dirs
    extra = ("--draft", str(draft_dir)) if draft else ()
    f = write(tmp_path / "p.jsonl", [{"prompt_ids": p} for p in ID_PROMPTS[:4]])
    args = ("--max-tokens", "8", "--temperature", "0.9", "--top-k", "20", "--seed", "11", *extra)
    got = batch(capsys, bare, f, *args)
    for p, rec in zip(ID_PROMPTS[:4], got):
        same_record(rec, single(capsys, bare, "--prompt-ids", ",".join(map(str, p)), *args))


def test_text_file_matches_single_prompt_runs(capsys, dirs, tmp_path):
    withtok, _, draft_dir = dirs
    if withtok is None:
        pytest.skip("no tokenizer could be built")
    texts = ["the cat sat on a mat", "dog", "then it was very small and green and the red house ran to a big tree"]
    f = tmp_path / "prompts.txt"
    f.write_text(texts[0] + "\n\n" + texts[1] + "\n   \n" + texts[2] + "\n")  # blank lines are skipped
    for extra in [(), ("--draft", str(draft_dir))]:
        got = batch(capsys, withtok, f, "--max-tokens", "6", *extra)
        assert len(got) == 3
        for text, rec in zip(texts, got):
            want = single(capsys, withtok, "--prompt", text, "--max-tokens", "6", *extra)
            same_record(rec, want)
            assert rec["num_prompt_tokens"] == len(text.split())
            assert isinstance(rec["text"], str)
    # JSONL may mix text and ids
    g = write(tmp_path / "mixed.jsonl", [{"prompt": texts[0]}, {"prompt_ids": [7, 8, 9], "max_tokens": 2}])
    got = batch(capsys, withtok, g, "--max-tokens", "6")
    same_record(got[0], single(capsys, withtok, "--prompt", texts[0], "--max-tokens", "6"))
    same_record(got[1], single(capsys, withtok, "--prompt-ids", "7,8,9", "--max-tokens", "2"))


def test_human_readable_output(capsys, dirs, tmp_path):
    _, bare, _ = dirs
    f = write(tmp_path / "p.jsonl", [{"prompt_ids": [1, 2, 3]}, {"prompt_ids": [4, 5]}])
    rc, out, err = run(capsys, "--model", str(bare), "--prompts-file", str(f), "--max-tokens", "3")
    assert rc == 0
    assert out.count("--- prompt") == 2
    assert "2 requests" in err


# --------------------------------------------------------------------------------------------------------------
# bad files: exit 2, one line "blockspec: error: ...", naming the file (and the line)


def error(capsys, model, path) -> str:
    rc, out, err = run(capsys, "--model", str(model), "--prompts-file", str(path), "--json", "--max-tokens", "2")
    assert rc == 2, (rc, out, err)
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockspec: error: "), err
    return lines[0]


GOOD = {"prompt_ids": [1, 2, 3]}
BAD_LINES = {
    "invalid-json": '{"prompt_ids": [1, 2,',
    "not-an-object": "[1, 2, 3]",
    "missing-keys": {"max_tokens": 3},
    "both-keys": {"prompt": "a", "prompt_ids": [1]},
    "prompt-not-text": {"prompt": 5},
    "ids-empty": {"prompt_ids": []},
    "ids-not-a-list": {"prompt_ids": "1,2"},
    "ids-not-ints": {"prompt_ids": [1, "2"]},
    "ids-bool": {"prompt_ids": [True]},
    "ids-float": {"prompt_ids": [1.0]},
    "max-tokens-zero": {"prompt_ids": [1], "max_tokens": 0},
    "max-tokens-negative": {"prompt_ids": [1], "max_tokens": -4},
    "max-tokens-string": {"prompt_ids": [1], "max_tokens": "3"},
    "max-tokens-float": {"prompt_ids": [1], "max_tokens": 2.5},
    "max-tokens-bool": {"prompt_ids": [1], "max_tokens": True},
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_line_names_file_and_line(capsys, dirs, tmp_path, case):
    _, bare, _ = dirs
    # the bad line is the 4th line of the file (a blank line before it counts)
    f = write(tmp_path / "bad.jsonl", [GOOD, GOOD, "", BAD_LINES[case], GOOD])
    msg = error(capsys, bare, f)
    assert f"{f}:4" in msg, msg
    if case.startswith("max-tokens"):
        assert "max_tokens" in msg


def test_bad_line_in_a_txt_named_jsonl_file(capsys, dirs, tmp_path):
    """A file whose first line is a JSON object is read as JSONL whatever its name."""
    _, bare, _ = dirs
    f = write(tmp_path / "prompts.txt", [GOOD, '{"prompt_ids": oops}'])
    assert f"{f}:2" in error(capsys, bare, f)


@pytest.mark.parametrize("content", ["", "\n\n", "   \n\t\n"], ids=["empty", "newlines", "whitespace"])
def test_empty_file(capsys, dirs, tmp_path, content):
    _, bare, _ = dirs
    f = tmp_path / "empty.jsonl"
    f.write_text(content)
    msg = error(capsys, bare, f)
    assert str(f) in msg and "empty" in msg


def test_missing_file_and_directory(capsys, dirs, tmp_path):
    _, bare, _ = dirs
    missing = tmp_path / "nope.jsonl"
    assert str(missing) in error(capsys, bare, missing)
    assert str(tmp_path) in error(capsys, bare, tmp_path)


def test_not_utf8(capsys, dirs, tmp_path):
    _, bare, _ = dirs
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9 au lait\n")
    assert str(f) in error(capsys, bare, f)


def test_text_prompt_without_tokenizer(capsys, dirs, tmp_path):
    _, bare, _ = dirs
    f = tmp_path / "p.txt"
    f.write_text("hello there\n")
    msg = error(capsys, bare, f)
    assert str(f) in msg and "tokenizer" in msg


# The file's lines are valid JSON with the right keys, but the ids do not fit the model. The error comes from the
# engine's check_prompt (blockspec/cli/generate.py _run_prompts_file -> LLM.generate -> LLMEngine.add_request), so it
# exits 2 with one line, but the message does not say which file or line holds the bad prompt.
@pytest.mark.parametrize("bad", [
    {"prompt_ids": [1, 2, 999]},  # outside the vocabulary
    {"prompt_ids": [3] * 300},  # longer than the context (256)
])
def test_prompt_ids_that_do_not_fit_the_model_exit_2(capsys, dirs, tmp_path, bad):
    _, bare, _ = dirs
    f = write(tmp_path / "p.jsonl", [GOOD, bad])
    msg = error(capsys, bare, f)
    assert "vocabulary" in msg or "context" in msg


@pytest.mark.parametrize("bad", [{"prompt_ids": [1, 2, 999]}, {"prompt_ids": [3] * 300}], ids=["vocab", "too-long"])
def test_prompt_ids_that_do_not_fit_the_model_name_file_and_line(capsys, dirs, tmp_path, bad):
    _, bare, _ = dirs
    f = write(tmp_path / "p.jsonl", [GOOD, "", bad])
    assert f"{f}:3" in error(capsys, bare, f)
