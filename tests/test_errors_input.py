"""Bad input gets one clear line naming the thing ("blockspec: error: ..."), exit status 2, never a traceback:
prompts, sampling values, devices, model paths, and once as a real subprocess. Broken checkpoints: test_errors.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from errors_utils import REPO_ROOT, ckpt, copy_ckpt, drop_tensor, edit_config, gen, run_cli  # noqa: F401 (fixtures)

# --------------------------------------------------------------------------------------------------------------
# prompt


def test_prompt_longer_than_context(copy_ckpt, capsys):
    d = copy_ckpt()
    edit_config(d, max_position_embeddings=16)
    msg = gen(capsys, d, "--prompt-ids", ",".join(str(i % 100 + 3) for i in range(20)))
    assert "context" in msg
    assert "20" in msg and "16" in msg


def test_prompt_filling_the_context_exactly(copy_ckpt, capsys):
    d = copy_ckpt()
    edit_config(d, max_position_embeddings=16)
    msg = gen(capsys, d, "--prompt-ids", ",".join(["5"] * 16))
    assert "context" in msg


@pytest.mark.parametrize("ids, bad", [("5,128", "128"), ("5,100000", "100000"), ("=-1,5", "-1")])
def test_prompt_id_outside_vocab(ckpt, capsys, ids, bad):
    arg = f"--prompt-ids{ids}" if ids.startswith("=") else None
    extra = [arg] if arg else ["--prompt-ids", ids]
    msg = gen(capsys, ckpt, *extra)
    assert "vocabulary" in msg
    assert bad in msg
    assert "128" in msg  # the vocabulary size


def test_prompt_ids_not_integers(ckpt, capsys):
    msg = gen(capsys, ckpt, "--prompt-ids", "1,two,3")
    assert "--prompt-ids" in msg
    assert "two" in msg


def test_empty_prompt_ids(ckpt, capsys):
    msg = gen(capsys, ckpt, "--prompt-ids", ",")
    assert "empty" in msg


def test_prompt_text_without_tokenizer(ckpt, capsys):
    msg = gen(capsys, ckpt, "--prompt", "hello there")
    assert "tokenizer" in msg
    assert "--prompt-ids" in msg


def test_chat_with_prompt_ids(ckpt, capsys):
    msg = gen(capsys, ckpt, "--prompt-ids", "1,2", "--chat")
    assert "--chat" in msg


# --------------------------------------------------------------------------------------------------------------
# sampling values, device, model path


@pytest.mark.parametrize(
    "flag, value, field",
    [
        ("--top-p", "1.5", "top_p"),
        ("--top-p", "0", "top_p"),
        ("--temperature", "-1", "temperature"),
        ("--temperature", "nan", "temperature"),
        ("--temperature", "inf", "temperature"),
        ("--top-k", "-2", "top_k"),
        ("--max-tokens", "0", "max_tokens"),
        ("--seed", "-5", "seed"),
    ],
)
def test_invalid_sampling_values_via_cli(ckpt, capsys, flag, value, field):
    _, msg = run_cli(capsys, "--model", str(ckpt), "--device", "cpu", "--prompt-ids", "1,2", flag, value)
    assert field in msg
    assert "invalid sampling value" in msg


@pytest.mark.parametrize("device", ["tpu", "quantum", "cuda:x"])
def test_unknown_device(ckpt, capsys, device):
    msg = gen(capsys, ckpt, "--device", device)
    assert repr(device) in msg


def test_unsupported_device_type(ckpt, capsys):
    msg = gen(capsys, ckpt, "--device", "meta")
    assert "'meta'" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda(ckpt, capsys):
    msg = gen(capsys, ckpt, "--device", "cuda")
    assert "CUDA is not available" in msg


def test_nonexistent_model_path(tmp_path, capsys):
    missing = tmp_path / "no" / "such_model"
    msg = gen(capsys, missing)
    assert "not found" in msg
    assert str(missing) in msg


def test_model_file_not_gguf(ckpt, capsys):
    msg = gen(capsys, ckpt / "model.safetensors")
    assert ".gguf" in msg
    assert "config.json" in msg


# --------------------------------------------------------------------------------------------------------------
# a real process: exit status 2, one line on stderr, no traceback


def _subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "blockspec", "generate", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
    )


def test_subprocess_missing_tensor(copy_ckpt):
    d = copy_ckpt()
    drop_tensor(d, "model.norm.weight")
    p = _subprocess("--model", str(d), "--device", "cpu", "--prompt-ids", "1,2,3", "--top-p", "0.5", "--temperature", "0.7")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockspec: error: "), p.stderr
    assert "missing 1 tensor" in lines[0] and "norm.weight" in lines[0]
    assert p.stdout == ""


def test_subprocess_argparse_usage_error_is_not_a_traceback():
    p = _subprocess("--prompt-ids", "1", "--max-tokens", "many")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "--max-tokens" in p.stderr
