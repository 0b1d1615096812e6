"""The Qwen3-MoE family (blockspec/models/qwen3_moe.py, layers/moe.py) against transformers' Qwen3MoeForCausalLM on
tiny random configs, fp32 on CPU: logits and taps from an HF directory (per-expert and stacked names) and from GGUF
files the test writes (F32 and Q8_0 expert banks), prefill then decode; the grouped kernel's row invariance; greedy
speculative decoding through the batched engine equal to plain decoding; bad MoE configs failing in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import ModelLoadError
from blockspec.layers import kernels
from blockspec.layers.moe import Router, SparseMoeBlock, grouped_experts, softmax_topk
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.gguf_io import read_gguf
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.ngram import NgramProposer
from dflash_utils import make_zlab_draft
from engine_utils import assert_equal_plain, one_device_and_tp2, spec_consistency
from errors_utils import edited_copy, run_cli
from moe_utils import (VOCAB, assert_matches_transformers, make_hf_moe, moe_block, prefill_decode,
                       quantize_experts, save_moe, write_moe_gguf)

CPU = LoadConfig(device="cpu", with_tokenizer=False)
# (seed, config overrides): every layer sparse and renormalized; a dense layer in the middle, weights not renormalized,
# tied embeddings; every second layer sparse (decoder_sparse_step), attention biases
CONFIGS = {
    "all-sparse": (0, {}),
    "mlp-only-layer": (1, dict(mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True,
                               num_experts_per_tok=3)),
    "sparse-step-2": (2, dict(decoder_sparse_step=2, num_hidden_layers=4, attention_bias=True)),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_model(request):
    seed, overrides = CONFIGS[request.param]
    return make_hf_moe(seed, **overrides)


def test_hf_directory_matches_transformers(hf_model, tmp_path):
    lm = load_model(str(save_moe(hf_model, tmp_path / "m")), CPU)
    cfg = hf_model.config
    sparse = [i for i, layer in enumerate(lm.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == [i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers
                      and (i + 1) % cfg.decoder_sparse_step == 0]
    assert_matches_transformers(lm, hf_model)


def test_stacked_expert_banks_load_too(tmp_path):
    """transformers 5 keeps each layer's experts stacked (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); a checkpoint saved from that state dict loads as the per-expert one does."""
    hf = make_hf_moe(3)
    d = save_moe(hf, tmp_path / "stacked")  # config.json as HF writes it; the weights replaced below
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(d / "model.safetensors"))
    assert_matches_transformers(load_model(str(d), CPU), hf)


@pytest.mark.parametrize("qtype", [None, QT.Q8_0], ids=["f32", "q8_0-experts"])
def test_gguf_matches_transformers(tmp_path, qtype):
    """llama.cpp's qwen3moe layout: stacked ffn_*_exps banks (quantized as one tensor each), ffn_gate_inp, the
    expert metadata keys; a layer without a router is dense (mlp_only_layers)."""
    hf = make_hf_moe(4, mlp_only_layers=[2])
    raw = quantize_experts(hf, qtype) if qtype is not None else None  # hf now runs the dequantized banks
    path = write_moe_gguf(tmp_path / "m.gguf", hf, raw, qtype)
    cfg = read_gguf(path).config
    assert (cfg["architectures"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
            cfg["norm_topk_prob"], cfg["mlp_only_layers"]) == (["Qwen3MoeForCausalLM"], 8, 2, 32, True, [2])
    assert_matches_transformers(load_model(str(path), CPU), hf)


@pytest.mark.parametrize("edit,needle", [
    ({"qwen3moe.expert_used_count": None}, "required GGUF metadata key 'qwen3moe.expert_used_count' is missing"),
    ({"qwen3moe.expert_count": 4}, "'blk.0.ffn_gate_exps.weight' has shape [8, 32, 64]; a stacked expert bank is "
                                   "[expert_count=4, out, in]"),
    ({"qwen3moe.expert_used_count": 9}, "field 'num_experts_per_tok' must be at most num_experts=8, got 9"),
])
def test_bad_gguf_moe_metadata(tmp_path, edit, needle):
    hf = make_hf_moe(4)
    path = write_moe_gguf(tmp_path / "bad.gguf", hf, **edit)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), CPU)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- the grouped kernel ----------------------------------------------------------------------------------------


def test_grouped_path_equals_the_per_row_formula():
    """Each row: its top-k experts' outputs, weighted, summed in ascending expert id (what HF's loop computes)."""
    block = moe_block(0)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = block(x)
        weights, ids = softmax_topk(block.gate(x), block.top_k, True)
        for t in range(len(x)):
            want = torch.zeros(64)
            for j in ids[t].argsort().tolist():  # ascending expert id
                want = want + block.experts[int(ids[t, j])](x[t:t + 1])[0] * weights[t, j]
            assert torch.allclose(got[t], want, rtol=1e-5, atol=1e-5), t
    assert torch.allclose(weights.sum(-1), torch.ones(len(x)))
    assert len(set(ids.flatten().tolist())) == 8  # every expert ran in the batch
    assert grouped_experts(x[:0], weights[:0], ids[:0], block.experts).shape == (0, 64)


def test_rows_are_bitwise_invariant_with_the_invariant_gemm(monkeypatch):
    """With the batch-invariant GEMM in the experts and the router (Triton's interpreter on CPU), a row's MoE output
    is bitwise the same alone, in a decode batch or in a verify block: the per-row accumulation order is fixed."""
    pytest.importorskip("triton")
    from blockspec.layers.invariant_linear import make_batch_invariant

    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    block = moe_block(2)
    make_batch_invariant(block)
    assert isinstance(block.gate, Router)  # the router is not swapped: it takes the invariant GEMM by itself
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = block(x)
        for rows in [[5], [0], [16], [3, 4, 5, 6, 7], [11, 2, 9]]:
            assert torch.equal(block(x[rows]), full[rows]), rows


# ---- DFlash on a MoE target: greedy speculative == plain, through the batched engine ----------------------------


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_pair")
    hf = make_hf_moe(7, mlp_only_layers=[1])
    save_moe(hf, root / "t")
    make_zlab_draft(hf.config, root / "d", block_size=8, target_layer_ids=[0, 1, 2], scale=2.0)
    lm = load_model(str(root / "t"), CPU)
    return lm, load_draft(SpeculativeConfig(draft_model=str(root / "d")), lm)


@pytest.mark.parametrize("proposer", ["dflash", "ngram"])
def test_greedy_speculative_equals_plain_through_the_engine(moe_pair, proposer):
    """Verify blocks of K + 1 rows over the experts their rows chose give the tokens plain decoding gives. The
    random drafter is mostly rejected; n-gram lookup, on the loops a random tiny target falls into, accepts long runs,
    so accepted verify rows are exercised too."""
    lm, draft = moe_pair
    drafter = draft if proposer == "dflash" else NgramProposer(5, 3)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 3, 26)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 40, 30, 20, 8, 28)]
    llm = LLM.from_loaded(lm, drafter, engine=EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=64))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_equal_plain(lm, prompts, params, outs)
    spec_consistency(outs)
    if proposer == "ngram":
        assert max(max(o.acceptance_lengths) for o in outs) > 2


@pytest.mark.parametrize("variant", ["cpu_packed", "q8"])
def test_cpu_variants_swap_the_experts_and_keep_the_router_exact(moe_pair, variant):
    """--cpu-packed packs every expert for oneDNN, --cpu-quant q8 quantizes them; the router is left alone in both
    (never packed or quantized: a changed router flips expert choices). Packed logits stay within fp32 rounding of
    the reference; greedy speculative decoding of the quantized target still equals its plain decoding."""
    from blockspec.layers import cpu_packed, cpu_quant

    cpu = torch.device("cpu")
    if not (cpu_packed.fp32_supported(cpu) if variant == "cpu_packed" else cpu_quant.supported(variant, cpu)):
        pytest.skip(f"this CPU or torch build does not run {variant}")
    lm, _ = moe_pair
    options = dict(cpu_packed=True) if variant == "cpu_packed" else dict(cpu_quant=variant)
    other = load_model(str(lm.source.path), LoadConfig(device="cpu", with_tokenizer=False, **options))
    block = other.model.layers[0].mlp
    assert type(block.gate) is Router and block.gate.weight.dtype == torch.float32
    assert type(block.experts[0].down_proj) is not torch.nn.Linear  # swapped for the variant's linear
    if variant == "cpu_packed":
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2))
        assert (prefill_decode(other, ids, 8, [])[0] - prefill_decode(lm, ids, 8, [])[0]).abs().max().item() <= 1e-4
        return
    prompts = [[5, 9, 33], [70, 2, 11, 64, 8, 1, 90]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    outs = LLM.from_loaded(other, NgramProposer(4, 2),
                           engine=EngineConfig(block_size=8)).generate(prompts, params, use_tqdm=False)
    assert_equal_plain(other, prompts, params, outs)


# ---- tensor parallelism: every expert split over its intermediate channels, gloo on CPU ---------------------


def test_expert_shards_and_tp_sizes(moe_pair):
    """Each rank keeps its slice of every expert's intermediate channels (gate|up rows, down columns) and one
    all-reduce per MoE layer; the router is replicated. A size that does not divide moe_intermediate_size fails."""
    import copy
    import dataclasses

    from blockspec.distributed.layers import AllReduceSum
    from blockspec.distributed.parallel_state import TPGroup
    from blockspec.distributed.shard import check_tp_size, shard_target
    from blockspec.errors import ConfigError

    lm, _ = moe_pair
    full = lm.model.layers[0].mlp
    model = copy.deepcopy(lm.model)
    shard_target(model, TPGroup(1, 2, None, None, torch.device("cpu")))  # rank 1 of 2 (no collective runs here)
    block = model.layers[0].mlp
    assert isinstance(block, AllReduceSum) and torch.equal(block.inner.gate.weight, full.gate.weight)
    e = 5
    gu, down = full.experts[e].gate_up_proj.weight, full.experts[e].down_proj.weight  # I = 32
    assert torch.equal(block.inner.experts[e].gate_up_proj.weight, torch.cat([gu[16:32], gu[48:64]]))
    assert torch.equal(block.inner.experts[e].down_proj.weight, down[:, 16:32])
    assert not isinstance(model.layers[1].mlp, AllReduceSum)  # the dense layer is row-parallel as for dense targets
    check_tp_size(2, lm.config, "target")
    raw = {**lm.config.raw, "moe_intermediate_size": 6}
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=4 must divide the target's moe_intermediate_size=6$"):
        check_tp_size(4, dataclasses.replace(lm.config, raw=raw), "target")


def test_engine_tp2_with_a_drafter_equals_one_device(moe_pair):
    """LLM(tensor_parallel_size=2) on a MoE target with its DFlash drafter: the tokens and acceptance lengths of one
    device (the ranks load, shard and route on their own)."""
    lm, draft = moe_pair
    prompts = [[5, 9, 33, 2], [70, 2, 11], [41]]
    want, got = one_device_and_tp2(lm, draft, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert got == want


# ---- bad configs: one line naming the field and the value -----------------------------------------------------


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> Path:
    return save_moe(make_hf_moe(0), tmp_path_factory.mktemp("moe_ckpt"))


def test_hub_style_config_loads(moe_ckpt, tmp_path):
    """The hub's configs name the expert count num_experts (transformers 5 writes num_local_experts)."""
    d = Path(shutil.copytree(moe_ckpt, tmp_path / "m"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (d / "config.json").write_text(json.dumps(cfg))
    ids = torch.arange(10)
    hub, ours = load_model(str(d), CPU), load_model(str(moe_ckpt), CPU)
    assert hub.model.moe.num_experts == 8
    assert torch.equal(prefill_decode(hub, ids, 6, [])[0], prefill_decode(ours, ids, 6, [])[0])


@pytest.mark.parametrize("edit,needle", [
    ({"num_experts_per_tok": 9}, "field 'num_experts_per_tok' must be at most num_local_experts=8, got 9"),
    ({"num_experts_per_tok": "2"}, "field 'num_experts_per_tok' must be an integer >= 1, got '2'"),
    ({"moe_intermediate_size": None}, "required field 'moe_intermediate_size' is missing"),
    ({"moe_intermediate_size": 0}, "field 'moe_intermediate_size' must be an integer >= 1, got 0"),
    ({"num_local_experts": None}, "required field 'num_experts' is missing"),
    ({"num_experts": 4}, "fields 'num_experts'=4 and 'num_local_experts'=8 disagree"),
    ({"decoder_sparse_step": 0}, "field 'decoder_sparse_step' must be an integer >= 1, got 0"),
    ({"mlp_only_layers": [3]}, "field 'mlp_only_layers' must list layer indices below num_hidden_layers=3, got [3]"),
    ({"norm_topk_prob": "yes"}, "field 'norm_topk_prob' must be true or false, got 'yes'"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' must be 'silu' for Qwen3MoeForCausalLM, got 'gelu'"),
    ({"use_sliding_window": True}, "field 'use_sliding_window' is true; sliding-window attention is not supported"),
])
def test_bad_moe_configs_fail_in_one_line(moe_ckpt, tmp_path, capsys, edit, needle):
    d = edited_copy(moe_ckpt, tmp_path / "m", edit)
    _, msg = run_cli(capsys, "--model", str(d), "--prompt-ids", "1,2", "--device", "cpu")
    assert needle in msg and str(d) in msg, msg
