"""One name per meaning of "block" on the command line: --kv-block-size is a page of the KV pool (EngineConfig's
block_size; serve, chat), --draft-block-size the DFlash drafter's block (train-draft, init-draft). The old spelling
--block-size still works on each of them for one release and says once, on stderr, which flag replaces it; --help
shows the new names only."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from blockspec.cli import COMMANDS, chat, init_draft, main, serve, train
from blockspec.cli.flags import engine_config
from hf_utils import make_hf_model, save_hf_model

# command -> (its module, the new flag, the field or argument it sets, the arguments it needs besides)
COMMANDS_WITH_A_BLOCK = {
    "serve": (serve, "--kv-block-size", "block_size", []),
    "chat": (chat, "--kv-block-size", "block_size", []),
    "train-draft": (train, "--draft-block-size", "draft_block_size", ["--data", "d", "--out", "o"]),
    "init-draft": (init_draft, "--draft-block-size", "draft_block_size", ["--out", "o"]),
}
BARE = re.compile(r"(?<![\w-])--block-size\b")  # the old spelling, not the tail of a new one


def parse(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_args(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("command", COMMANDS_WITH_A_BLOCK)
def test_the_new_flag_sets_its_value_quietly(command, capsys):
    module, flag, dest, needed = COMMANDS_WITH_A_BLOCK[command]
    assert getattr(parse(module, needed + [flag, "8"]), dest) == 8
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", COMMANDS_WITH_A_BLOCK)
def test_the_old_spelling_still_works_and_warns_once(command, capsys):
    module, flag, dest, needed = COMMANDS_WITH_A_BLOCK[command]
    args = parse(module, needed + ["--block-size", "8", "--block-size", "4"])
    assert getattr(args, dest) == 4  # the last one given, as for any flag
    assert capsys.readouterr().err == f"blockspec: warning: --block-size is deprecated, use {flag}\n"
    assert getattr(parse(module, needed + ["--block-size", "8", flag, "2"]), dest) == 2  # the two spellings mix


@pytest.mark.parametrize("command", COMMANDS_WITH_A_BLOCK)
def test_the_defaults_are_unchanged(command):
    module, _, dest, needed = COMMANDS_WITH_A_BLOCK[command]
    default = {"serve": 16, "chat": 16, "train-draft": None, "init-draft": 16}[command]  # train-draft: 16 or --init's
    assert getattr(parse(module, needed), dest) == default


def test_the_kv_block_size_reaches_the_engine_config(capsys):
    assert engine_config(parse(serve, [])) == {}
    assert engine_config(parse(serve, ["--kv-block-size", "8"])) == {"block_size": 8}
    assert engine_config(parse(chat, ["--block-size", "32"])) == {"block_size": 32}
    assert "deprecated" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a bad value is argparse's error under either spelling
        parse(serve, ["--block-size", "many"])
    assert "argument --block-size: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_shows_the_new_names_only(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert not BARE.search(out), f"`blockspec {command} --help` still shows --block-size"
    if command in COMMANDS_WITH_A_BLOCK:
        assert COMMANDS_WITH_A_BLOCK[command][1] in out


def test_init_draft_writes_the_same_drafter_under_either_spelling(tmp_path, capsys):
    target = save_hf_model(make_hf_model("llama"), tmp_path / "target")
    capsys.readouterr()  # the checkpoint writer's progress bar
    for name, flag in (("new", "--draft-block-size"), ("old", "--block-size")):
        assert main(["init-draft", "--target", str(target), "--out", str(tmp_path / name), flag, "4"]) == 0
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("new", "old")]
    assert weights[0] == weights[1]
    assert capsys.readouterr().err == "blockspec: warning: --block-size is deprecated, use --draft-block-size\n"


@pytest.mark.parametrize("argv, message", [
    (["--draft-block-size", "1"], "--draft-block-size=1 must be >= 2 (slot 0 holds the given token)"),
    (["--init", "x", "--draft-block-size", "4"], "--draft-block-size cannot be combined with --init"),
])
def test_train_draft_names_the_new_flag(tmp_path, capsys, argv, message):
    # refused before anything loads: the target and the data need only exist
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    args = ["train-draft", "--target", str(tmp_path), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "o")]
    assert main(args + argv) == 2
    assert capsys.readouterr().err.startswith(f"blockspec: error: {message}")
