"""The fused mixture-of-experts kernel (blockspec/layers/fused_moe.py) on CPU under Triton's interpreter (the same
kernel compiles for CUDA in tests/test_gpu_dflash2_moe.py): its pair layout, its output against the grouped path,
row invariance, and the MoE target through the engine with the fused path on."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU machine the kernels compile for CUDA
    pytest.skip("needs Triton's interpreter (set on machines without CUDA)", allow_module_level=True)
from blockspec.config import EngineConfig
from blockspec.layers import kernels  # noqa: E402
from blockspec.layers.fused_moe import BLOCK_M, align_pairs, fused_experts  # noqa: E402
from blockspec.layers.moe import grouped_experts, softmax_topk  # noqa: E402
from moe_utils import moe_block  # noqa: E402


@pytest.mark.parametrize("T,k,E", [(1, 2, 8), (5, 3, 8), (17, 3, 8), (40, 8, 64), (3, 1, 4)])
def test_pairs_are_grouped_by_expert_and_padded_to_whole_tiles(T, k, E):
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(T * 7 + i))[:k] for i in range(T)])
    pairs, tile_expert = align_pairs(ids, E)
    P = T * k
    assert pairs.numel() == tile_expert.numel() * BLOCK_M
    seen = []
    for t, e in enumerate(tile_expert.tolist()):
        tile = pairs[t * BLOCK_M:(t + 1) * BLOCK_M].tolist()
        real = [p for p in tile if p < P]
        if e == E:  # past the last used tile: padding only
            assert not real
            continue
        assert real and all(int(ids.view(-1)[p]) == e for p in real), (t, e)
        assert tile[:len(real)] == real and all(p == P for p in tile[len(real):])  # padding at the run's end
        seen += real
    assert sorted(seen) == list(range(P))  # every pair exactly once
    used = [e for e in tile_expert.tolist() if e < E]
    assert used == sorted(used)  # ascending expert id, each pair in order within its expert (stable)
    assert all(seen[i] < seen[i + 1] for i in range(len(seen) - 1) if ids.view(-1)[seen[i]] == ids.view(-1)[seen[i + 1]])


def _fused(block, x):
    weights, ids = block.route(x)
    return fused_experts(x, weights, ids, *block.stacked)


def test_fused_equals_the_grouped_path_and_rows_are_bitwise_invariant(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    block = moe_block(4)
    block.stack_experts()
    assert block.stacked is not None and block.experts[3].gate_up_proj.weight.data_ptr() == block.stacked[0][3].data_ptr()
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = block(x)  # the fused path: the interpreter stands in for CUDA
        weights, ids = softmax_topk(block.gate(x), block.top_k, True)
        ref = grouped_experts(x, weights, ids, block.experts)
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(full, _fused(block, x))
        for rows in [[5], [0], [20], [3, 4, 5, 6, 7], [11, 2, 9], list(range(16))]:
            assert torch.equal(block(x[rows]), full[rows]), rows
    assert len(set(ids.flatten().tolist())) == 8


def test_experts_the_kernel_cannot_take_keep_the_grouped_path():
    block = moe_block(1)
    block.experts[0].down_proj.bias = torch.nn.Parameter(torch.zeros(64))
    block.stack_experts()
    assert block.stacked is None


def test_moe_target_through_the_engine_with_the_fused_kernel(monkeypatch, tmp_path):
    """A tiny Qwen3-MoE target whose MoE layers run the fused kernel (prepared as on CUDA): greedy DFlash and
    n-gram speculation equal plain decoding, and plain decoding equals the grouped path's."""
    from blockspec.llm import LLM
    from blockspec.loading.loader import LoadConfig, load_model
    from blockspec.sampling import SamplingParams
    from blockspec.speculative.ngram import NgramProposer
    from moe_utils import VOCAB, make_hf_moe, save_moe

    save_moe(make_hf_moe(3, mlp_only_layers=[1]), tmp_path / "t")
    cfg = LoadConfig(device="cpu", with_tokenizer=False)
    grouped = load_model(str(tmp_path / "t"), cfg)
    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    fused = load_model(str(tmp_path / "t"), cfg)
    blocks = [m for m in fused.model.modules() if hasattr(m, "stacked")]
    assert blocks and all(b.stacked is not None for b in blocks)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 11, 7)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for name, lm, drafter in [("grouped", grouped, None), ("fused", fused, None),
                              ("fused ngram", fused, NgramProposer(5, 3))]:
        if name == "grouped":
            monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", False)
        llm = LLM.from_loaded(lm, drafter, engine=EngineConfig(block_size=8, max_num_seqs=3, enforce_eager=True))
        runs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    assert runs["fused"] == runs["grouped"] == runs["fused ngram"]
