"""Tensor parallelism on CPU (gloo): parallel layers equal full ones, a TP=2 forward matches TP=1, and the engine at
TP=2 gives the same greedy tokens and acceptance lengths as one device, with a DFlash drafter (Llama and Qwen3)."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from dense_cache import DenseCausalAttention, DenseKVCache
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.distributed.layers import (HeadSplit, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, column_linear,
                                          head_split, vocab_shard)
from blockspec.distributed.parallel_state import destroy_tp, free_port, init_tp
from blockspec.distributed.shard import check_tp_size, shard_pair
from blockspec.errors import ConfigError
from blockspec.llm import LLM
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from blockspec.train.export import hf_state_dict
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model
from trained_pair import CYCLE_A, CYCLE_B, trained_pair


def save_draft(draft: LoadedDraft, config_dir: Path, out: Path) -> Path:
    """Write an in-memory (trained) drafter in the z-lab checkpoint format (packed projections unpacked)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", out / "config.json")
    save_file(hf_state_dict(draft.model), str(out / "model.safetensors"))
    return out


# ---- layer and model level: two gloo ranks made with torch.multiprocessing.spawn -------------------------------------


def _layers_and_model(rank: int, world: int, port: int, model_dirs: list[str]) -> None:
    torch.set_num_threads(1)
    tp = init_tp(rank, world, port, torch.device("cpu"))
    try:
        torch.manual_seed(0)  # the same full weights on every rank
        x = torch.randn(5, 12)
        up, down = torch.nn.Linear(12, 8, bias=True), torch.nn.Linear(8, 12, bias=True)
        col = column_linear(up, [(rank * 4, 4)])
        row = RowParallelLinear(down, rank * 4, 4, tp.group)
        torch.testing.assert_close(row(col(x)), down(up(x)), rtol=0, atol=1e-6)
        emb = torch.randn(11, 12)  # 11 rows over 2 ranks: the last shard is padded
        start, shard = vocab_shard(emb, rank, world)
        ids = torch.tensor([0, 5, 6, 10, 3])
        assert torch.equal(VocabParallelEmbedding(shard, start, tp.group)(ids), emb[ids])
        torch.testing.assert_close(ParallelLMHead(shard, 11, world, tp.group)(x), x @ emb.T, rtol=0, atol=1e-6)
        assert head_split(4, 1, rank, world) == HeadSplit(rank * 2, 2, 0, 1)  # one kv head: replicated
        assert head_split(8, 4, rank, world) == HeadSplit(rank * 4, 4, rank * 2, 2)

        for d in model_dirs:  # a full forward vs this rank's shard of the same model
            lm = load_model(d, LoadConfig(device="cpu", with_tokenizer=False))
            cfg = lm.config
            ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
            pos = torch.arange(9)
            full = forward(lm, ids, pos)
            lm_tp, _ = shard_pair(copy.deepcopy(lm), None, tp)
            assert lm_tp.config.num_attention_heads == cfg.num_attention_heads // world
            part = forward(lm_tp, ids, pos)
            torch.testing.assert_close(part.logits, full.logits, rtol=0, atol=1e-5)
            torch.testing.assert_close(part.taps, full.taps, rtol=0, atol=1e-5)
    finally:
        destroy_tp()


def forward(lm, ids: torch.Tensor, pos: torch.Tensor):
    cfg = lm.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, len(ids), cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        return lm.model(ids, pos, DenseCausalAttention(cache, pos, len(ids)), tap_layers=[0, 1])


def test_parallel_layers_and_sharded_forward_match_one_device(tmp_path):
    llama = save_hf_model(make_hf_model("llama", seed=3, tie_word_embeddings=True), tmp_path / "llama")
    # one KV head for two ranks: replicated on both
    qwen3 = save_hf_model(make_hf_model("qwen3", seed=4, num_key_value_heads=1, vocab_size=127), tmp_path / "qwen3")
    mp.spawn(_layers_and_model, args=(2, free_port(), [str(llama), str(qwen3)]), nprocs=2, join=True)


# ---- engine level: LLM(tensor_parallel_size=2) vs one device ---------------------------------------------------------


def _engine_outputs(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outs], [o.acceptance_lengths for o in outs]


def test_engine_tp2_equals_one_device_trained_llama_pair(tmp_path):
    pair = trained_pair()
    target = str(pair.lm.source.path)
    draft_dir = save_draft(pair.draft, pair.lm.source.path.parent / "draft", tmp_path / "draft")
    prompts = [CYCLE_A[:6], CYCLE_B[3:12], CYCLE_A[5:8] + CYCLE_B[:4]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)]
    one = LLM.from_loaded(pair.lm, pair.draft, engine=EngineConfig(block_size=8, num_kv_blocks=64))
    want_tokens, want_accept = _engine_outputs(one, prompts, params)
    tp = LLM(target, speculative={"draft_model": str(draft_dir)}, load=LoadConfig(device="cpu"),
             engine=EngineConfig(tensor_parallel_size=2, block_size=8, num_kv_blocks=64))
    try:
        got_tokens, got_accept = _engine_outputs(tp, prompts, params)
    finally:
        tp.close()
    assert got_tokens == want_tokens
    assert got_accept == want_accept
    assert sum(map(sum, want_accept)) / sum(map(len, want_accept)) > 3  # the trained drafter is really exercised


def test_engine_tp2_equals_one_device_qwen3_probabilistic_drafts(tmp_path):
    """Random Qwen3 pair; the sampled request drafts from q and verifies with p/q rejection on every rank."""
    hf = make_hf_model("qwen3", seed=5)
    target = save_hf_model(hf, tmp_path / "qwen3")
    make_zlab_draft(hf.config, tmp_path / "draft", layers=1, block_size=4, target_layer_ids=(0, 2), mask_token_id=127)
    spec = {"draft_model": str(tmp_path / "draft"), "probabilistic_drafting": True}
    prompts = [[5, 9, 33, 2 + i] for i in range(3)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=24, ignore_eos=True)]
    lm = load_model(str(target), LoadConfig(device="cpu", with_tokenizer=False))
    one = LLM.from_loaded(lm, load_draft(SpeculativeConfig(**spec), lm))
    want = _engine_outputs(one, prompts, params)
    tp = LLM(str(target), speculative=spec, load=LoadConfig(device="cpu"), engine=EngineConfig(tensor_parallel_size=2))
    try:
        assert _engine_outputs(tp, prompts, params) == want
    finally:
        tp.close()
    assert any(n > 1 for n in want[1][2])  # some sampled drafts were accepted through p/q rejection


def test_cli_generate_tp2_equals_one_device(tmp_path, capsys):
    from blockspec.cli import main

    model = save_hf_model(make_hf_model("llama", seed=6), tmp_path / "llama")
    argv = ["generate", "--model", str(model), "--prompt-ids", "3,4,5", "--max-tokens", "12", "--device", "cpu",
            "--json"]
    outs = []
    for extra in ([], ["--tensor-parallel-size", "2"]):
        assert main(argv + extra) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert len(outs[0]["token_ids"]) == 12
    assert outs[1]["token_ids"] == outs[0]["token_ids"]
    assert outs[1]["tensor_parallel_size"] == 2


# ---- bad sizes ---------------------------------------------------------------------------------------------------------


def test_bad_tensor_parallel_sizes(tmp_path):
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=0 must be an integer >= 1$"):
        EngineConfig(tensor_parallel_size=0)
    cfg = load_model(str(save_hf_model(make_hf_model("llama"), tmp_path / "m")),
                     LoadConfig(device="cpu", with_tokenizer=False)).config  # 4 heads, 2 kv heads, intermediate 96
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=3 must divide the target's num_attention_heads=4$"):
        check_tp_size(3, cfg, "target")
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=4 must divide the target's intermediate_size=90$"):
        check_tp_size(4, dataclasses.replace(cfg, intermediate_size=90), "target")
    with pytest.raises(ConfigError, match=r"num_key_value_heads=3 or be a multiple of it \(KV heads are then"):
        check_tp_size(2, dataclasses.replace(cfg, num_attention_heads=6, num_key_value_heads=3), "target")
    check_tp_size(4, cfg, "target")  # 2 kv heads on 4 ranks: replicated, allowed
    # the LLM checks before it starts any rank
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size=3 must divide the target \(.*/m\)'s num_attention"):
        LLM(str(tmp_path / "m"), load=LoadConfig(device="cpu"), engine=EngineConfig(tensor_parallel_size=3))
