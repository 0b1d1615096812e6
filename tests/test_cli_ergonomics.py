"""The command line as a new user meets it: `--help` of every command answers in well under a second (its module
imports nothing heavy until it runs), a bad flag prints that command's usage, and a missing model, drafter or
prompts file fails in one line naming the flag before the command runs (so before the target loads)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockspec.cli import COMMANDS, main
from blockspec.errors import ModelLoadError
from blockspec.loading.bundled_draft import BUNDLED_DRAFT_DIR
from blockspec.loading.source import check_source, resolve_source

REPO_ROOT = Path(__file__).resolve().parents[1]
# what a command must not import to print its help or refuse its flags: each costs seconds on a loaded machine
HEAVY = ("torch", "transformers", "safetensors", "blockspec.llm", "blockspec.engine", "blockspec.loading.loader")
# the fewest arguments each command needs, so that a bad flag is the only thing wrong
REQUIRED = {"generate": ["--prompt", "x"], "demo": [], "bench": [], "init-draft": ["--out", "o"], "serve": [],
            "chat": [], "draft-data": ["--prompts", "p", "--out", "o"], "eval-draft": ["--dataset", "gsm8k"],
            "train-draft": ["--data", "d", "--out", "o"], "export-draft": ["d", "--out", "o.gguf"]}


def _in_fresh_python(code: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    return done, time.perf_counter() - t0


def _imported_after(argv: list[str]) -> str:
    """Code that runs `blockspec ARGV` in-process and prints [exit status, the HEAVY modules it imported] as JSON."""
    return "\n".join(["import json, sys", "from blockspec.cli import main", "try:", f"    rc = main({argv!r})",
                      "except SystemExit as e:", "    rc = e.code",
                      f"print(json.dumps([rc, [m for m in {HEAVY!r} if m in sys.modules]]))"])


def test_the_table_covers_every_command():
    assert set(REQUIRED) == set(COMMANDS)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_is_fast_and_imports_nothing_heavy(command):
    done, seconds = _in_fresh_python(_imported_after([command, "--help"]))
    assert done.returncode == 0, done.stderr
    assert f"usage: blockspec {command}" in done.stdout
    rc, heavy = json.loads(done.stdout.splitlines()[-1])
    # the machine-independent check; if torch comes in through blockspec.config, its imports of ModelConfig and
    # DFlashConfig (annotations only) belong under TYPE_CHECKING
    assert rc == 0 and heavy == [], f"`blockspec {command} --help` imported {heavy}"
    assert seconds < 5.0  # generous: ~0.1 s on an idle 2-core machine, 13 s when torch was imported under load


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_flag_prints_the_commands_usage(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, *REQUIRED[command], "--bogus=1"])  # one word: serve and chat would take a 1 as MODEL
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: blockspec {command} ")
    assert err.endswith(f"blockspec {command}: error: unrecognized arguments: --bogus=1\n")


def test_a_bad_value_prints_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--max-tokens", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: blockspec generate ")
    assert "blockspec generate: error: argument --max-tokens: invalid int value: 'many'" in err


@pytest.fixture
def never_runs(monkeypatch):
    """Every command's run() fails the test: an input error must come before the command starts loading."""
    import importlib

    for command in COMMANDS.values():
        module = importlib.import_module(f"blockspec.cli.{command.module}")
        monkeypatch.setattr(module, "run", lambda args: pytest.fail("the command ran: its inputs were not checked"))


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("blockspec: error: "), err
    return lines[0][len("blockspec: error: "):]


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--prompt", "x", "--draft", "{absent}"], "--draft"),
    (["generate", "--prompt", "x", "--model", "{absent}"], "--model"),
    (["generate", "--prompts-file", "{absent}"], "--prompts-file"),
    (["chat", "--draft", "{absent}"], "--draft"),
    (["chat", "{absent}"], "MODEL"),
    (["serve", "--model", "{absent}"], "--model"),
    (["serve", "--draft", "{absent}"], "--draft"),
    (["bench", "--draft", "{absent}"], "--draft"),
    (["bench", "--model", "{absent}"], "--model"),
    (["eval-draft", "--dataset", "gsm8k", "--draft", "{absent}"], "--draft"),
    (["init-draft", "--target", "{absent}", "--out", "o"], "--target"),
    (["export-draft", "{absent}", "--out", "o.gguf"], "DRAFT"),
    (["export-draft", str(BUNDLED_DRAFT_DIR), "--target", "{absent}", "--out", "o.gguf"], "--target"),
    (["train-draft", "--data", "{absent}", "--out", "o"], "--data"),
    (["train-draft", "--data", ".", "--out", "o", "--eval-prompts", "{absent}"], "--eval-prompts"),
])
def test_a_missing_input_is_named_before_the_command_runs(never_runs, tmp_path, capsys, argv, flag):
    absent = str(tmp_path / "absent")
    message = _error(capsys, [a.replace("{absent}", absent) for a in argv])
    assert message.startswith(f"{flag} {absent}: ")


@pytest.mark.parametrize("flag", ["--prompts", "--init"])
def test_train_draft_checks_its_prompts_and_init_before_loading(monkeypatch, tmp_path, capsys, flag):
    import blockspec.train.launch as launch

    monkeypatch.setattr(launch, "session", lambda dp: pytest.fail("train-draft started: its inputs were not checked"))
    absent = str(tmp_path / "absent")
    source = ["--prompts", absent] if flag == "--prompts" else ["--data", str(tmp_path), "--init", absent]
    message = _error(capsys, ["train-draft", *source, "--out", str(tmp_path / "o")])
    assert message == f"{flag} {absent}: no such {'file or directory' if flag == '--prompts' else 'directory'}"


def test_a_model_directory_without_config_and_a_file_not_gguf_are_named(never_runs, tmp_path, capsys):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    message = _error(capsys, ["generate", "--prompt", "x", "--draft", str(tmp_path)])
    assert message == f"--draft {tmp_path}: not a model directory: {tmp_path / 'config.json'} is missing"
    message = _error(capsys, ["generate", "--prompt", "x", "--model", str(tmp_path / "weights.safetensors")])
    assert message.startswith(f"--model {tmp_path / 'weights.safetensors'}: a model file must be .gguf")
    message = _error(capsys, ["generate", "--prompts-file", str(tmp_path)])
    assert message == f"--prompts-file {tmp_path}: not a file"


def test_a_missing_drafter_fails_fast_without_importing_the_loaders(tmp_path):
    absent = str(tmp_path / "drafter")
    done, seconds = _in_fresh_python(_imported_after(["generate", "--prompt", "x", "--draft", absent]))
    rc, heavy = json.loads(done.stdout.splitlines()[-1])
    assert rc == 2 and done.stderr == f"blockspec: error: --draft {absent}: not found: no such file or directory\n"
    assert not {"blockspec.loading.loader", "blockspec.llm", "blockspec.engine"} & set(heavy), heavy
    assert seconds < 5.0


@pytest.mark.parametrize("source", [None, "some-org/some-model", "Qwen/Qwen3-8B"])
def test_hub_ids_and_the_bundled_default_pass_unchecked(source):
    check_source(source, "--model")  # no network, no error: they are resolved when loaded


def test_a_hub_like_path_under_a_local_directory_is_local(tmp_path, monkeypatch):
    # `models/qwen3` where ./models exists is a typo in a local path, not a repository named qwen3 of user "models"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelLoadError) as e:
        check_source("models/qwen3", "--draft")
    assert str(e.value).startswith("--draft models/qwen3: not found: models/ is a local directory without qwen3")
    with pytest.raises(ModelLoadError) as e:
        resolve_source("models/qwen3")  # the loader reads it the same way: no download is tried
    assert "models/ is a local directory without qwen3" in str(e.value)


def test_a_gguf_file_and_a_home_path_are_local(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    check_source("~/m.gguf", "--model")  # exists: the loader reads the header
    for missing in ("~/absent.gguf", "org/absent.gguf"):
        with pytest.raises(ModelLoadError, match="no such file or directory"):
            check_source(missing, "--model")
