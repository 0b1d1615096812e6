"""Shared by the bad-input tests (test_errors*.py): a tiny checkpoint to break, and the CLI driven in-process with
its one-line error format checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from blockspec.cli import main
from hf_utils import make_hf_model, save_hf_model

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny random HF llama (config.json + model.safetensors, no tokenizer), built once for the module."""
    return save_hf_model(make_hf_model("llama", seed=0), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def copy_ckpt(ckpt, tmp_path):
    """Returns a fresh, mutable copy of the checkpoint directory."""
    n = [0]

    def make() -> Path:
        n[0] += 1
        return Path(shutil.copytree(ckpt, tmp_path / f"model{n[0]}"))

    return make


def edit_config(d: Path, **changes) -> None:
    """config.json's fields set to `changes`; a field given None is removed."""
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def edited_copy(ckpt: Path, dst: Path, changes: dict) -> Path:
    """A copy of the checkpoint directory `ckpt` at `dst` with its config.json edited (edit_config)."""
    d = Path(shutil.copytree(ckpt, dst))
    edit_config(d, **changes)
    return d


def run_cli(capsys, *args: str) -> tuple[int, str]:
    """Runs `blockspec generate ...` in-process; checks the one-line error format; returns (rc, message)."""
    capsys.readouterr()
    rc = main(["generate", *args])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("blockspec: error: "), err
    return rc, lines[0][len("blockspec: error: "):]


def gen(capsys, model: Path | str, *extra: str) -> str:
    args = ["--model", str(model), "--device", "cpu", "--max-tokens", "2", *extra]
    if not any(a.startswith(("--prompt", "--prompt-ids")) for a in extra):
        args += ["--prompt-ids", "1,2,3"]
    return run_cli(capsys, *args)[1]


def drop_tensor(d: Path, name: str) -> None:
    """Removes one tensor from d/model.safetensors."""
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    assert name in tensors
    del tensors[name]
    save_file(tensors, str(f), metadata={"format": "pt"})
