"""The engine benchmarks on CPU: benchmarks.datagen at a tiny shape (forced acceptance, benchmark-only, is the
same on the varlen step and the decode step, so the split_mixed_steps A/B generates the same tokens at the forced
tau in both rows), benchmarks.host, and the vectorized block-table builder it measures."""

from __future__ import annotations

import pytest
import torch

from benchmarks.datagen import measure, workload
from benchmarks.host import decode_step_ms
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
    assert on["host_breakdown_s"]["varlen_step_calls"] > 0 and on["host_breakdown_s"]["decode_step_calls"] > 0
    assert on["host_breakdown_s"]["decode_step_calls"] > off["host_breakdown_s"]["decode_step_calls"]


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
