"""The engine benchmarks on CPU: benchmarks.datagen at a tiny shape (forced acceptance, benchmark-only, is the
same on the varlen step and the decode step, so the split_mixed_steps A/B generates the same tokens at the forced
tau in both rows), benchmarks.host, the vectorized block-table builder it measures, and the step benchmark's floor
(the bytes a decode step reads) with its recomputation of a recorded run."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.datagen import measure, workload
from benchmarks.host import decode_step_ms
from benchmarks.parts import floor_bytes
from benchmarks.random_pair import make_pair
from blockspec.engine.decode_step import DecodeStep
from blockspec.engine.sequence import Sequence, block_tables
from blockspec.host_tensors import host_tensor
from blockspec.sampling import SamplingParams
from blockspec.speculative.stats import SpecStats

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=32, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True)


def test_split_ab_same_tokens_at_the_forced_tau():
    lm, draft = make_pair(TINY, 5, 1, [0, 2], 255, torch.device("cpu"), torch.float32)
    prompts, params = workload(24, 255, (5, 40), (10, 40))
    off, on = (measure(lm, draft, 8, 3.5, prompts, params, split) for split in (False, True))
    assert off["token_ids"] == on["token_ids"]
    assert [len(t) for t in on["token_ids"]] == [p.max_tokens for p in params]
    # tau 3.5 = 2 or 3 drafts accepted, half and half; blocks cut by max_tokens accept fewer
    assert 3.0 < off["measured_tau"] == on["measured_tau"] <= 3.5, (off["measured_tau"], on["measured_tau"])
    # both paths really ran in the split row: steps admitting requests next to decoding ones
    decode = [h.get("decode_runs", 0) for h in (off["host_breakdown_s"], on["host_breakdown_s"])]  # launched or chained
    assert on["host_breakdown_s"]["varlen_calls"] > 0 and decode[1] > decode[0] > 0


def test_block_tables_pads_with_block_zero():
    seqs = [Sequence(str(i), [1], SamplingParams(), set(), 8, True, 0, SpecStats(3), block_table=table)
            for i, table in enumerate([[5, 9, 2], [], [7]])]
    assert block_tables(seqs, 4, torch.device("cpu")).tolist() == [[5, 9, 2, 0], [0, 0, 0, 0], [7, 0, 0, 0]]
    assert block_tables([], 4, torch.device("cpu")).shape == (0, 4)


def test_host_bench_restores_the_decode_step():
    real = DecodeStep.forward
    assert decode_step_ms(4, 3, 2, new_tokens=24) > 0
    assert DecodeStep.forward is real


@pytest.mark.parametrize("values,dtype", [([3, 1, 2], torch.int64), ([[1, 2], [3, 4]], torch.int64), ([], torch.int64),
                                          ([[], []], torch.int64), ([0.5, 1.0], torch.float32),
                                          ([True, False], torch.bool), ([7, 9], torch.int32)])
def test_host_tensor_equals_torch_tensor(values, dtype):
    got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_floor_counts_what_a_step_reads():
    lm, draft = make_pair(TINY, 5, 1, [0, 2], 255, torch.device("cpu"), torch.float32)
    B, ctx, K, f32 = 3, 40, 5, 4
    table = 256 * 32 * f32  # tied: the lm_head is the embedding table, read once as the head
    layer = (32 * (32 + 2 * 16) + 32 * 32 + 32 * 2 * 64 + 64 * 32 + 2 * 32) * f32  # qkv, o, gate|up, down, 2 norms
    kv_row = 4 * 2 * 8 * 2 * f32  # layers x kv heads x head dim x (k, v)
    ar = floor_bytes(lm, None, B, ctx)
    assert ar == {"target_matrices": 4 * layer + 32 * f32, "lm_head": table, "embedding_rows": B * 32 * f32,
                  "kv": B * (ctx + 1) * kv_row, "total": sum(v for k, v in ar.items() if k != "total")}
    spec = floor_bytes(lm, draft, B, ctx)
    draft_layer = layer + 2 * 8 * f32  # the target's shape, with Qwen3's q/k norms
    assert spec["drafter"] == draft_layer + (2 * 32 * 32 + 2 * 32) * f32  # + fc over 2 taps, hidden and final norm
    assert spec["drafter_context_kv_rows"] == 2 * 16 * 32 * f32  # its k|v rows read again for the context append
    assert spec["draft_lm_head"] == table and spec["lm_head"] == table
    assert spec["embedding_rows"] == B * ((K + 1) + (K + 1)) * 32 * f32  # verify rows + draft block rows
    assert spec["kv"] == B * (ctx + K + 1) * kv_row and spec["draft_kv"] == B * (ctx + 1) * kv_row // 4
    assert spec["total"] == sum(v for k, v in spec.items() if k != "total")


def test_recompute_floor_of_a_recorded_run(tmp_path):
    from benchmarks.step import meta_pair, recompute_floor

    lm, draft = meta_pair(15)
    ar, spec = floor_bytes(lm, None, 1, 1024), floor_bytes(lm, draft, 1, 1024)
    # the Qwen3-8B shape: layers and final norm, an untied 151,936 x 4,096 head, 1,025 keys x 36 layers x 8 heads x
    # 128 x (k, v) in bf16; the 5-layer drafter with its fc over 5 taps
    assert ar == {"target_matrices": 13_892_151_296, "lm_head": 1_244_659_712, "embedding_rows": 8192,
                  "kv": 151_142_400, "total": 15_287_961_600}
    assert spec["drafter"] == 2_097_252_864 and spec["total"] == 18_737_218_048
    row = {"batch": 1, "context": 1024, "K": 15, "ar_step_ms": 5.0, "spec_step_ms": 6.0}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"copy_bandwidth_GBps": 4000.0, "floor_ms_bs1": 4.1, "spec_floor_ms_bs1": 4.9,
                                "ar_step_ms_bs1": 5.0, "spec_step_ms_bs1": 6.0, "table": [row],
                                "breakdown_bs1_ctx1k": {"ar": {"gemm_ms": 4.0}, "spec": {"gemm_ms": 5.0}}}))
    recompute_floor(str(path))
    out = json.loads(path.read_text())
    assert out["floor_as_run"]["floor_ms_bs1"] == 4.1 and out["floor_bytes"]["ar"] == ar
    assert out["floor_ms_bs1"] == pytest.approx(15_287_961_600 / 4e12 * 1e3)
    assert out["ar_ratio_to_floor_bs1"] == pytest.approx(5.0 / out["floor_ms_bs1"])
    assert out["spec_ratio_to_floor_bs1"] == pytest.approx(6.0 / (18_737_218_048 / 4e12 * 1e3))
    assert out["table"][0]["ar_ratio_to_floor"] == pytest.approx(out["ar_ratio_to_floor_bs1"])
    gemm = (13_892_151_296 + 1_244_659_712) / 4e12 * 1e3
    assert out["breakdown_bs1_ctx1k"]["ar"]["gemm_ratio_to_floor"] == pytest.approx(4.0 / gemm, rel=1e-4)
    recompute_floor(str(path))  # again: the floor as run is kept, the rest recomputed the same
    assert json.loads(path.read_text()) == out
