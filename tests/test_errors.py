"""Bad input gets one clear line naming the thing ("blockspec: error: ..."), exit status 2, never a traceback: broken
checkpoints (config.json, weights). Prompts, sampling values, devices and a real subprocess: test_errors_input.py.

The CLI is driven in-process through blockspec.cli.main (capsys)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from blockspec.cli import main
from errors_utils import ckpt, copy_ckpt, drop_tensor, edit_config, gen  # noqa: F401 (ckpt, copy_ckpt: fixtures)

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
    drop_tensor(d, hf_name)
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
