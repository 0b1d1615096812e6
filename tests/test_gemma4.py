"""The Gemma 4 family (blockspec/models/gemma4.py, gemma4_spec.py) against transformers' Gemma4ForCausalLM and
Gemma4ForConditionalGeneration on tiny random configs, fp32 on CPU, driven through the paged attention over a KV pool
(tests/paged_utils.py: prompts prefilled together in part, then decoded a token per step): logits and taps, sliding
windows shorter than the prompts, global layers with their own head size (and, with attention_k_eq_v, their own K/V
head count and values = keys), KV shared between layers, per-layer inputs, soft-capped logits, the MoE variant; the
multimodal checkpoint's language model; bad configs failing in one line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec.attention.paged_ref import RowwiseTargetAttention
from blockspec.errors import ConfigError
from blockspec.kv.pool import CacheShape
from blockspec.loading.loader import LoadConfig, load_model
from errors_utils import edited_copy
from paged_utils import TritonTargetAttention, assert_matches

CPU = LoadConfig(device="cpu", with_tokenizer=False)
VOCAB = 128
SLIDE, FULL = "sliding_attention", "full_attention"
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=5, max_position_embeddings=512,
            vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=0, bos_token_id=2, eos_token_id=1,
            pad_token_id=0)
# (seed, overrides, the pool transformers' layers come to: (caches, kv heads, head size))
CONFIGS = {
    # E2B-like: per-layer inputs, the last two layers sharing K/V, soft-capped logits (a cap that bites), tied
    # embeddings
    "shared-kv-per-layer-inputs": (0, dict(hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                                           final_logit_softcapping=2.0, layer_types=[SLIDE, FULL, SLIDE, FULL]),
                                   (2, 2, 32)),
    # 31B-like: global layers with values = keys and one K/V head (repeated to the pool's two), biases, own head
    "k-eq-v": (1, dict(attention_k_eq_v=True, num_global_key_value_heads=1, attention_bias=True,
                       tie_word_embeddings=False, layer_types=[SLIDE, SLIDE, FULL, FULL], sliding_window=3),
               (4, 2, 32)),
    # 26B-A4B-like: routed experts beside the dense MLP, the default layer pattern, a double-wide sharing layer
    "moe": (2, dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                    num_hidden_layers=7, num_kv_shared_layers=1, use_double_wide_mlp=True), (6, 2, 32)),
}
PROMPTS = [(37, 30), (9, 1), (20, 12)]  # (length, prefilled part): windows of 3 and 5 are much shorter


def make_hf(seed: int, conditional: bool = False, **overrides):
    """A tiny Gemma 4 text model (or multimodal checkpoint with a one-layer vision tower) in fp32; norms, layer
    scalars and the router's scales perturbed (HF's init leaves them at one), the router's projection scaled up so
    routing has clear margins."""
    import transformers as tf

    text = {**BASE, **overrides}
    torch.manual_seed(seed)
    if conditional:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16)
        cfg = tf.Gemma4Config(text_config=text, vision_config=vision, image_token_id=120, video_token_id=121,
                              audio_token_id=122, boi_token_id=123, eoi_token_id=124, boa_token_id=125,
                              eoa_token_index=126)
        model = tf.Gemma4ForConditionalGeneration(cfg)
    else:
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**text))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("router.proj.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # a buffer in HF (in the checkpoint): a parameter here, so it loads
                b.uniform_(0.5, 1.5)
    return model


def prompts(seed: int = 5) -> tuple[list[torch.Tensor], list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n, _ in PROMPTS], [s for _, s in PROMPTS]


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    seed, overrides, _ = CONFIGS[request.param]
    hf = make_hf(seed, **overrides)
    path = tmp_path_factory.mktemp("gemma4") / request.param
    hf.save_pretrained(str(path))
    return request.param, hf, load_model(str(path), CPU)


def test_hf_directory_matches_transformers(pair):
    name, hf, lm = pair
    assert lm.model.kv_cache_shape() == CacheShape(*CONFIGS[name][2])
    assert_matches(lm, hf, *prompts())


def test_rowwise_attention_matches_too(pair):
    _, hf, lm = pair
    assert_matches(lm, hf, *prompts(6), attention=RowwiseTargetAttention)


def test_triton_kernel_with_windows_and_shared_kv():
    """The Triton paged kernel (interpreter on CPU) given each layer's window, over a pool of the model's shape."""
    pytest.importorskip("triton")
    seed, overrides, _ = CONFIGS["shared-kv-per-layer-inputs"]
    hf = make_hf(seed, **overrides)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        lm = load_model(d, CPU)
    g = torch.Generator().manual_seed(8)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in (14, 6)]
    assert_matches(lm, hf, ids, [10, 1], attention=TritonTargetAttention)


def test_conditional_generation_checkpoint_serves_its_language_model(tmp_path, capfd):
    """model.language_model.* loaded as the text model, the vision tower skipped, media placeholder ids looked up as
    the pad token (as HF does), one stderr line saying media inputs are not supported."""
    hf = make_hf(3, conditional=True, **CONFIGS["shared-kv-per-layer-inputs"][1])
    hf.save_pretrained(str(tmp_path / "m"))
    capfd.readouterr()
    lm = load_model(str(tmp_path / "m"), CPU)
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["blockspec: Gemma4ForConditionalGeneration: loading the language model only; image, video and "
                   "audio inputs are not supported"]
    ids, splits = prompts(9)
    ids[0][3], ids[2][5] = 120, 122  # an image and an audio placeholder in the text
    assert_matches(lm, hf, ids, splits)


def test_layer_scalars_left_out_of_a_checkpoint_are_one(tmp_path):
    """HF initializes a layer_scalar the checkpoint does not hold to 1; the loader does alike."""
    from safetensors.torch import load_file, save_file

    hf = make_hf(4, **CONFIGS["k-eq-v"][1])
    for name, b in hf.named_buffers():
        if name.endswith("layer_scalar"):
            b.fill_(1.0)
    hf.save_pretrained(str(tmp_path / "m"))
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    kept = {k: v for k, v in state.items() if not k.endswith("layer_scalar")}
    save_file(kept, str(tmp_path / "m" / "model.safetensors"))
    lm = load_model(str(tmp_path / "m"), CPU)
    assert all(float(layer.layer_scalar) == 1.0 for layer in lm.model.layers)
    assert_matches(lm, hf, *prompts())


# ---- bad configs: one line naming the field --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma4_ckpt")
    make_hf(0, **CONFIGS["shared-kv-per-layer-inputs"][1]).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("edit,field,needle", [
    ({"layer_types": [SLIDE, "local", SLIDE, FULL]}, "layer_types", "each 'sliding_attention' or 'full_attention'"),
    ({"sliding_window": None}, "sliding_window", "is required and missing"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers", "must leave a layer computing K/V"),
    ({"num_kv_shared_layers": 3}, "num_kv_shared_layers", "leaves a layer kind with no earlier layer"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention", "must be one of None, 'vision'"),
    ({"hidden_activation": "relu"}, "hidden_activation", "must be one of 'gelu_pytorch_tanh', 'gelu', 'silu'"),
    ({"per_layer_config": {"1": {"head_dim": 32, "sliding_window": 9}}}, "per_layer_config",
     "layer 1: only positive head_dim / num_key_value_heads overrides"),
    ({"per_layer_config": {"1": {"num_key_value_heads": 3}}}, "num_key_value_heads",
     "dividing the largest (3), which must divide num_attention_heads=4; layer 0 has 2"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, "top_k_experts",
     "must be at most num_experts=4, got 5"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}, "moe_intermediate_size",
     "is required and missing"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_parameters",
     "must give each layer kind's rotary"),
    ({"final_logit_softcapping": 0}, "final_logit_softcapping", "must be a positive number, got 0"),
])
def test_bad_configs_fail_in_one_line_naming_the_field(ckpt, tmp_path, edit, field, needle):
    d = edited_copy(ckpt, tmp_path / "m", edit)
    with pytest.raises(ConfigError) as e:
        load_model(str(d), CPU)
    msg = str(e.value)
    assert e.value.field == field and f"field {field!r}" in msg and needle in msg and "\n" not in msg, msg


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_through_the_triton_kernel_matches_transformers(name, tmp_path):
    """fp32 on CUDA: the Triton rotary and paged kernel (each layer's window, a pool of the model's shape, shared
    K/V read without storing), the grouped experts: the CPU reference's numbers."""
    from paged_utils import assert_same_as_cpu

    seed, overrides, _ = CONFIGS[name]
    make_hf(seed, **overrides).save_pretrained(str(tmp_path / "m"))
    assert_same_as_cpu(str(tmp_path / "m"), *prompts())
