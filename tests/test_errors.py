"""Bad input gets one clear line naming the thing ("blockspec: error: ..."), exit status 2, never a traceback.

The CLI is driven in-process through blockspec.cli.main (capsys), and once as a real subprocess."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from blockspec.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny random HF llama (config.json + model.safetensors, no tokenizer), built once for the module."""
    try:
        from tests.hf_utils import make_hf_model, save_hf_model
    except ImportError:
        from hf_utils import make_hf_model, save_hf_model

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
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


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


# --------------------------------------------------------------------------------------------------------------
# control: the untouched checkpoint works, so every failure below is due to the one thing each test breaks


def test_valid_checkpoint_runs(ckpt, capsys):
    capsys.readouterr()
    rc = main(["generate", "--model", str(ckpt), "--device", "cpu", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out)
    assert result["num_prompt_tokens"] == 3
    assert 1 <= result["num_generated_tokens"] <= 3
    assert result["text"] is None  # no tokenizer in the directory


# --------------------------------------------------------------------------------------------------------------
# config.json


def test_missing_config_json(copy_ckpt, capsys):
    d = copy_ckpt()
    (d / "config.json").unlink()
    assert (d / "model.safetensors").exists()
    msg = gen(capsys, d)
    assert "config.json" in msg
    assert "missing" in msg


@pytest.mark.parametrize("content", ["{not json", "", "\x00\xff garbage", '{"architectures": ["LlamaForCausalLM"],'])
def test_corrupt_config_json(copy_ckpt, capsys, content):
    d = copy_ckpt()
    (d / "config.json").write_text(content, encoding="latin-1")
    msg = gen(capsys, d)
    assert str(d / "config.json") in msg
    assert "JSON" in msg


def test_config_json_not_an_object(copy_ckpt, capsys):
    d = copy_ckpt()
    (d / "config.json").write_text("[1, 2, 3]")
    msg = gen(capsys, d)
    assert str(d / "config.json") in msg


def test_config_missing_required_field(copy_ckpt, capsys):
    d = copy_ckpt()
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = gen(capsys, d)
    assert "hidden_size" in msg
    assert "config.json" in msg


def test_unknown_architecture(copy_ckpt, capsys):
    d = copy_ckpt()
    edit_config(d, architectures=["FooForCausalLM"])
    msg = gen(capsys, d)
    assert "'FooForCausalLM'" in msg
    assert "LlamaForCausalLM" in msg  # lists what is supported


def test_empty_architectures(copy_ckpt, capsys):
    d = copy_ckpt()
    edit_config(d, architectures=[])
    msg = gen(capsys, d)
    assert "architectures" in msg


def test_unknown_dtype_in_config(copy_ckpt, capsys):
    d = copy_ckpt()
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float8"
    (d / "config.json").write_text(json.dumps(cfg))
    msg = gen(capsys, d)
    assert "float8" in msg


# --------------------------------------------------------------------------------------------------------------
# weights


def test_missing_weights_file(copy_ckpt, capsys):
    d = copy_ckpt()
    (d / "model.safetensors").unlink()
    msg = gen(capsys, d)
    assert "no weights found" in msg
    assert str(d) in msg


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "truncated_data"])
def test_corrupt_safetensors(copy_ckpt, capsys, how):
    d = copy_ckpt()
    f = d / "model.safetensors"
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        f.write_bytes(b"\x13\x37" * 5000)
    elif how == "empty":
        f.write_bytes(b"")
    else:  # header intact, the last bytes of the tensor data gone
        f.write_bytes(data[:-16])
    msg = gen(capsys, d)
    assert str(f) in msg


def test_shape_mismatch_names_tensor_and_both_shapes(copy_ckpt, capsys):
    d = copy_ckpt()
    edit_config(d, intermediate_size=80)  # the weights were saved with intermediate_size 96
    msg = gen(capsys, d)
    m = re.search(r"tensor '([\w.]+)' has shape (\([\d, ]+\)) but the model config expects (\([\d, ]+\))", msg)
    assert m, msg
    name, got, want = m.groups()
    assert re.fullmatch(r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight", name), name
    with safe_open(str(d / "model.safetensors"), framework="pt") as h:
        actual = tuple(h.get_slice(name).get_shape())
    assert got == str(actual)
    assert want == str(tuple(80 if s == 96 else s for s in actual))
    assert str(d) in msg


def test_vocab_mismatch_names_embedding(copy_ckpt, capsys):
    d = copy_ckpt()
    edit_config(d, vocab_size=100)
    msg = gen(capsys, d)
    assert re.search(r"'(model\.embed_tokens|lm_head)\.weight'", msg), msg
    assert "128" in msg and "100" in msg


def _drop_tensor(d: Path, name: str) -> None:
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    assert name in tensors
    del tensors[name]
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "hf_name, shown",
    [
        ("model.norm.weight", "norm.weight"),
        ("model.layers.1.post_attention_layernorm.weight", "layers.1.post_attention_layernorm.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("model.layers.2.self_attn.o_proj.weight", "layers.2.self_attn.o_proj.weight"),
        ("model.layers.1.self_attn.k_proj.weight", "layers.1.self_attn.k_proj.weight"),  # packed into qkv_proj
        ("model.layers.0.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight"),  # packed into gate_up_proj
    ],
)
def test_missing_tensor_is_named(copy_ckpt, capsys, hf_name, shown):
    d = copy_ckpt()
    _drop_tensor(d, hf_name)
    msg = gen(capsys, d)
    assert "missing 1 tensor" in msg
    assert shown in msg
    assert str(d) in msg


def test_unexpected_tensor_is_named(copy_ckpt, capsys):
    d = copy_ckpt()
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(f), metadata={"format": "pt"})
    msg = gen(capsys, d)
    assert "'model.layers.0.mlp.extra_proj.weight'" in msg


def test_sharded_index_lists_missing_shard(copy_ckpt, capsys):
    d = copy_ckpt()
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})
    )
    msg = gen(capsys, d)
    assert "model-00001-of-00002.safetensors" in msg


def test_corrupt_sharded_index(copy_ckpt, capsys):
    d = copy_ckpt()
    (d / "model.safetensors.index.json").write_text("{oops")
    msg = gen(capsys, d)
    assert "model.safetensors.index.json" in msg


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
    _drop_tensor(d, "model.norm.weight")
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
