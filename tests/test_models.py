"""Our Llama/Qwen2/Qwen3 against transformers' on tiny random configs: logits and taps, fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from dense_cache import DenseCausalAttention, DenseKVCache
from blockspec.layers.norm import rms_norm
from blockspec.loading.loader import LoadConfig, load_model
from hf_utils import make_hf_model, save_hf_model

ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}
CASES = [
    ("llama", False, "default"), ("llama", True, "llama3"), ("llama", False, "linear"), ("llama", True, "yarn"),
    ("qwen2", False, "default"), ("qwen2", True, "yarn"), ("qwen3", False, "default"), ("qwen3", True, "linear"),
]


def run_ours(lm, ids: torch.Tensor, taps: list[int]):
    cfg = lm.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    pos = torch.arange(len(ids))
    with torch.no_grad():
        return lm.model(ids, pos, DenseCausalAttention(cache, pos, len(ids)), tap_layers=taps)


@pytest.mark.parametrize("arch,tied,rope", CASES)
def test_logits_and_taps_match_transformers(tmp_path, arch, tied, rope):
    hf = make_hf_model(arch, tie_word_embeddings=tied, rope_scaling=ROPE[rope])
    lm = load_model(str(save_hf_model(hf, tmp_path)), LoadConfig(device="cpu", with_tokenizer=False))
    assert lm.config.tie_word_embeddings == tied
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    n = lm.config.num_hidden_layers
    out = run_ours(lm, ids, taps=list(range(n)))
    assert (out.logits - ref.logits[0]).abs().max().item() <= 1e-4
    H = lm.config.hidden_size
    for i in range(n):  # including the last layer, whose HF entry is final-normed
        assert (out.taps[:, i * H:(i + 1) * H] - ref.hidden_states[i + 1][0]).abs().max().item() <= 1e-4


def test_tap_order_follows_request(tmp_path):
    hf = make_hf_model("qwen3")
    lm = load_model(str(save_hf_model(hf, tmp_path)), LoadConfig(device="cpu", with_tokenizer=False))
    ids = torch.randint(0, 128, (20,))
    a = run_ours(lm, ids, taps=[0, 1])
    b = run_ours(lm, ids, taps=[1, 0])
    H = lm.config.hidden_size
    assert torch.equal(a.taps[:, :H], b.taps[:, H:]) and not torch.equal(a.taps[:, :H], a.taps[:, H:])


def test_incremental_decode_matches_full_forward(tmp_path):
    """Prefill then one-token steps over the dense cache give the full-sequence logits."""
    hf = make_hf_model("llama")
    lm = load_model(str(save_hf_model(hf, tmp_path)), LoadConfig(device="cpu", with_tokenizer=False))
    ids = torch.randint(0, 128, (30,))
    full = run_ours(lm, ids, taps=[])
    cfg = lm.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, 30, cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    rows = []
    with torch.no_grad():
        pos = torch.arange(20)
        rows.append(lm.model(ids[:20], pos, DenseCausalAttention(cache, pos, 20)).logits)
        for p in range(20, 30):
            pos = torch.tensor([p])
            rows.append(lm.model(ids[p:p + 1], pos, DenseCausalAttention(cache, pos, p + 1)).logits)
    assert (torch.cat(rows) - full.logits).abs().max().item() <= 1e-5


def test_bf16_runs_close_to_fp32(tmp_path):
    hf = make_hf_model("qwen2")
    d = str(save_hf_model(hf, tmp_path))
    ids = torch.randint(0, 128, (16,))
    f32 = run_ours(load_model(d, LoadConfig(device="cpu", with_tokenizer=False)), ids, taps=[])
    lm16 = load_model(d, LoadConfig(device="cpu", dtype="bfloat16", with_tokenizer=False))
    assert next(lm16.model.parameters()).dtype == torch.bfloat16
    cfg = lm16.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, cfg.head_dim,
                                  torch.bfloat16, torch.device("cpu"))
    pos = torch.arange(16)
    with torch.no_grad():
        b16 = lm16.model(ids, pos, DenseCausalAttention(cache, pos, 16))
    assert (b16.logits - f32.logits).abs().max().item() < 0.1


def test_transformers5_style_config(tmp_path):
    """rope_parameters + dtype (transformers 5) and rope_theta + rope_scaling + torch_dtype (4) read the same."""
    from blockspec.models.config import ModelConfig

    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    v4 = ModelConfig.from_hf({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                              "rope_scaling": {"type": "linear", "factor": 2.0}})
    v5 = ModelConfig.from_hf({**base, "dtype": "bfloat16",
                              "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert (v4.rope_theta, v4.rope_scaling["factor"], v4.dtype) == (v5.rope_theta, v5.rope_scaling["factor"], v5.dtype)
    assert v4.rope_scaling["rope_type"] == v5.rope_scaling["rope_type"] == "linear"


def test_cpu_rms_norm_fast_path_equals_the_formula():
    """On CPU in fp32 rms_norm takes torch's one-call rms_norm (fewer eager ops per decode step): it must equal the
    fp32 formula bit for bit, or plain and speculative decoding, and HF parity, could drift with the torch version."""
    g = torch.Generator().manual_seed(0)
    for rows, dim, eps in [(1, 576, 1e-5), (4, 576, 1e-5), (17, 896, 1e-6), (3, 64, 1e-6), (33, 1536, 1e-6)]:
        x = torch.randn(rows, dim, generator=g) * 7
        w = torch.randn(dim, generator=g)
        formula = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        assert torch.equal(rms_norm(x, w, eps), formula)
