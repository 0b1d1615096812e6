"""Model families as files (models/llama.py, qwen2.py, qwen3.py on models/decoder.py), found through the lazy registry
(models/registry.py): each family's traits come from its config.json fields, a new family is one class plus one
registry line, and an unknown architecture fails in one line naming the supported ones."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.errors import ModelLoadError
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.models import registry
from blockspec.models.config import ModelConfig
from blockspec.models.decoder import DecoderForCausalLM, LayerTraits
from dense_cache import DenseCausalAttention, DenseKVCache
from hf_utils import make_hf_model, save_hf_model

TINY = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


class ToyForCausalLM(DecoderForCausalLM):
    """A family of the test's own: the shared decoder with q/k norm switched by a config field of its own."""

    @classmethod
    def layer_traits(cls, cfg: ModelConfig) -> LayerTraits:
        return LayerTraits(qk_norm=cfg.flag("use_qk_norm"))


@pytest.fixture
def own_registry(monkeypatch):
    """A copy of the registry for this test, so what it registers is gone afterwards."""
    monkeypatch.setattr(registry, "MODEL_REGISTRY", dict(registry.MODEL_REGISTRY))


def logits(lm, ids: torch.Tensor) -> torch.Tensor:
    cfg = lm.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    pos = torch.arange(len(ids))
    with torch.no_grad():
        return lm.model(ids, pos, DenseCausalAttention(cache, pos, len(ids))).logits


def assert_matches_transformers(hf, d: str) -> None:
    lm = load_model(d, LoadConfig(device="cpu", with_tokenizer=False))
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (logits(lm, ids) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch,file", [("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2"),
                                       ("Qwen3ForCausalLM", "qwen3")])
def test_each_architecture_is_served_by_its_own_family_file(arch, file):
    cls = registry.model_class(arch)
    assert cls.__name__ == arch and cls.__module__ == f"blockspec.models.{file}"
    assert issubclass(cls, DecoderForCausalLM)
    model = registry.build_model(ModelConfig.from_hf({**TINY, "architectures": [arch]}))
    assert type(model) is cls and len(model.layers) == 2


def test_gguf_names_come_from_the_family_files():
    assert registry.gguf_architectures() == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                             "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                                             "gpt-oss": "GptOssForCausalLM"}


@pytest.mark.parametrize("arch,fields,traits", [
    ("LlamaForCausalLM", {}, LayerTraits()),
    ("LlamaForCausalLM", {"attention_bias": True}, LayerTraits(qkv_bias=True, o_bias=True)),
    ("LlamaForCausalLM", {"mlp_bias": True}, LayerTraits(mlp_bias=True)),
    ("Qwen2ForCausalLM", {}, LayerTraits(qkv_bias=True)),
    ("Qwen2ForCausalLM", {"attention_bias": False}, LayerTraits(qkv_bias=True)),  # HF's Qwen2 has no such switch
    ("Qwen3ForCausalLM", {}, LayerTraits(qk_norm=True)),
    ("Qwen3ForCausalLM", {"attention_bias": True}, LayerTraits(qkv_bias=True, o_bias=True, qk_norm=True)),
])
def test_traits_come_from_config_fields(arch, fields, traits):
    with torch.device("meta"):
        model = registry.build_model(ModelConfig.from_hf({**TINY, "architectures": [arch], **fields}))
    assert model.traits == traits
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == (traits.qkv_bias, traits.o_bias)
    assert (mlp.gate_up_proj.bias is not None, mlp.down_proj.bias is not None) == (traits.mlp_bias,) * 2
    assert (attn.q_norm is not None, attn.k_norm is not None) == (traits.qk_norm,) * 2


def test_a_flag_of_another_type_names_the_field():
    cfg = ModelConfig.from_hf({**TINY, "architectures": ["LlamaForCausalLM"], "attention_bias": "yes"}, "x/config.json")
    with pytest.raises(ModelLoadError, match=r"^x/config\.json: field 'attention_bias' must be true or false"):
        registry.build_model(cfg)


@pytest.mark.parametrize("arch,fields", [("llama", {"attention_bias": True, "mlp_bias": True}),
                                         ("qwen3", {"attention_bias": True})])
def test_bias_fields_match_transformers(tmp_path, arch, fields):
    """The biases HF's attention_bias / mlp_bias add (on o_proj and the MLP too) load and compute as HF's."""
    hf = make_hf_model(arch, **fields)
    assert_matches_transformers(hf, str(save_hf_model(hf, tmp_path)))


def test_a_new_family_is_one_class_and_one_registry_line(tmp_path, own_registry):
    """A Qwen3 checkpoint relabelled as an architecture of the test's own: unknown until registered, then loaded
    through load_model with the test's family class and computing as transformers' Qwen3."""
    hf = make_hf_model("qwen3")
    d = save_hf_model(hf, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["ToyForCausalLM"], "use_qk_norm": True}))
    with pytest.raises(ModelLoadError, match="unknown architecture 'ToyForCausalLM'"):
        load_model(str(d), LoadConfig(device="cpu", with_tokenizer=False))

    registry.register("ToyForCausalLM", f"{__name__}:ToyForCausalLM")  # the one line

    assert type(load_model(str(d), LoadConfig(device="cpu", with_tokenizer=False)).model) is ToyForCausalLM
    assert_matches_transformers(hf, str(d))


def test_the_registry_imports_a_family_only_when_asked(own_registry):
    registry.register("LazyForCausalLM", "blockspec_no_such_module:LazyForCausalLM")  # nothing imported yet
    assert "LazyForCausalLM" in registry.supported()
    with pytest.raises(ModuleNotFoundError, match="blockspec_no_such_module"):
        registry.model_class("LazyForCausalLM")


def test_register_refuses_a_malformed_target_or_a_taken_name(own_registry):
    with pytest.raises(ValueError, match="'module:Class'"):
        registry.register("ToyForCausalLM", "ToyForCausalLM")
    with pytest.raises(ValueError, match="served by 'blockspec.models.llama:LlamaForCausalLM' already"):
        registry.register("LlamaForCausalLM", f"{__name__}:ToyForCausalLM")
    registry.register("LlamaForCausalLM", "blockspec.models.llama:LlamaForCausalLM")  # the same again: no-op


def test_unknown_architecture_is_one_line_naming_the_supported_ones():
    cfg = ModelConfig.from_hf({**TINY, "architectures": ["FooForCausalLM"]})
    with pytest.raises(ModelLoadError) as e:
        registry.build_model(cfg)
    # the list grows with every family: the sorted registry, which holds these at least
    assert str(e.value) == ("unknown architecture 'FooForCausalLM' in config.json 'architectures'; "
                            f"supported: {', '.join(registry.supported())}")
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForConditionalGeneration"} <= set(registry.supported())
