"""The host layout of a step (engine/step_layout.py) and the engine's public seams around its step paths: every
request's results get their own place in the step's one host copy, groups follow K and K', the test knobs are
EngineConfig fields (step_path, overlap) checked when built, and the decode step can be timed on its own
(LLMEngine.decode_step_bench)."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.engine.llm_engine import LLMEngine
from blockspec.engine.scheduler import ScheduledSeq
from blockspec.engine.sequence import Sequence
from blockspec.engine.step_layout import StepLayout
from blockspec.errors import BlockspecError, ConfigError
from blockspec.sampling import SamplingParams
from blockspec.speculative.drafts import Drafts
from blockspec.speculative.stats import SpecStats
from trained_pair import trained_pair


def seq(prompt: int, output: list[int], computed: int, drafts: list[int], temperature: float = 0.0) -> Sequence:
    s = Sequence(f"r{prompt}-{len(output)}", list(range(1, prompt + 1)), SamplingParams(temperature=temperature), set(),
                 64, True, 7, SpecStats(4))
    s.output_ids, s.num_computed, s.drafts = list(output), computed, Drafts(drafts)
    s.block_table = list(range(20, 20 + -(-(prompt + len(output) + 8) // 4)))
    return s


def test_varlen_layout_places_each_result_once():
    scheduled = [
        ScheduledSeq(seq(10, [5], 10, [6, 7, 8]), 4, False, 3),  # verifies 3 drafts, proposes 3
        ScheduledSeq(seq(12, [], 4, []), 5, True, 0),  # a prefill chunk that goes on: no result
        ScheduledSeq(seq(9, [], 0, []), 9, True, 3),  # a prefill that ends: its first token, then 3 drafts
        ScheduledSeq(seq(8, [5], 8, [6], temperature=1.0), 2, False, 2),  # verifies 1 draft, proposes 2
        ScheduledSeq(seq(6, [3, 4], 0, []), 7, True, 3),  # resumed after preemption: its bonus is known
        ScheduledSeq(seq(7, [2], 7, [3, 4, 5]), 4, False, 3),  # the first verify group again
    ]
    layout = StepLayout.for_varlen(scheduled, 4, 100)
    v = layout.varlen
    assert [(g.K, g.index) for g in v.verify] == [(3, [0, 5]), (1, [3])]
    assert [(g.K, g.index) for g in v.propose] == [(3, [0, 2, 4, 5]), (2, [3])]
    assert layout.tokens_at[1] == layout.drafts_at[1] == -1 and layout.tokens_at[4] == -1
    assert v.verify[0].flags["all_greedy"] and not v.verify[1].flags["all_greedy"]
    # the host copy: first tokens, then each verify group's [K+1 tokens, n], then each propose group's drafts
    spans = [(layout.tokens_at[2], 1), (layout.tokens_at[0], 5), (layout.tokens_at[5], 5), (layout.tokens_at[3], 3)]
    spans += [(layout.drafts_at[i], scheduled[i].next_k) for i in (0, 2, 4, 5, 3)]
    covered = sorted(p for at, n in spans for p in range(at, at + n))
    assert covered == list(range(len(covered)))  # every place once, no gap
    dev = v.pack.upload(torch.device("cpu"))
    assert v.input_ids.of(dev).tolist() == [5, 6, 7, 8, *range(5, 10), *range(1, 10), 5, 6, *range(1, 7), 3, 2, 3, 4, 5]
    assert v.query_start.of(dev).tolist() == [0, 4, 9, 18, 20, 27, 31]
    assert v.logit_rows.of(dev).tolist() == [0, 1, 2, 3, 17, 18, 19, 27, 28, 29, 30]
    assert v.prefill_start.of(dev).tolist() == [9, 7] and v.resumed.of(dev).tolist() == [4]


def test_decode_layout_reads_the_packed_rows():
    scheduled = [ScheduledSeq(seq(10, [5], 10, [6, 7]), 3, False, 2), ScheduledSeq(seq(8, [4], 8, [1, 2]), 3, False, 2)]
    layout = StepLayout.for_decode(scheduled)
    assert layout.input_ids == [5, 6, 7, 4, 1, 2] and layout.start == [10, 8]
    host = [6, 9, -1, 1, 11, 12, 3, 4, 5, 2, 13, 14]  # per request: 3 emitted slots, n, 2 next drafts
    results = layout.results(host, None)
    assert [(r.new_tokens, r.num_accepted, r.drafts.tokens) for r in results] == [([6, 9], 1, [11, 12]),
                                                                                 ([3, 4, 5], 2, [13, 14])]


def test_step_path_and_overlap_are_checked():
    with pytest.raises(ConfigError, match="step_path='decode' must be one of auto, varlen") as e:
        EngineConfig(step_path="decode")
    assert e.value.field == "step_path"
    with pytest.raises(ConfigError, match="overlap=True does not go with tensor parallelism"):
        EngineConfig(overlap=True, tensor_parallel_size=2)
    EngineConfig(overlap=False, tensor_parallel_size=2)


def test_decode_step_bench_runs_the_engines_step():
    pair = trained_pair()
    engine = LLMEngine(pair.lm, pair.draft, EngineConfig(max_num_seqs=2, num_kv_blocks=16, block_size=4))
    bench = engine.decode_step_bench(2, 3, 8)
    with torch.inference_mode():
        packed, q = bench.eager()
    assert packed.shape == (2, 3 + 2 + 3) and q is None
    assert ((packed[:, 4] >= 0) & (packed[:, 4] <= 3)).all()  # num_accepted
    with pytest.raises(BlockspecError, match="needs 20 KV blocks; the engine.s pool has 16"):
        engine.decode_step_bench(5, 3, 8)
