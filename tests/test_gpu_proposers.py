"""The n-gram and draft-model proposers on CUDA give the CPU engine's results, and their decode step replayed from
CUDA graphs gives the eager step's (run on the GPU machine; skipped where CUDA is absent)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from blockspec.speculative.draft_model import DraftModelProposer
from blockspec.speculative.ngram import NgramProposer
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

pytestmark = pytest.mark.gpu


def _workload():
    prompts = [cycle_seq((CYCLE_A, CYCLE_B)[i % 2], 3 * i, 5 + 7 * i) for i in range(10)]
    params = [SamplingParams(max_tokens=60, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=60, ignore_eos=True) for i in range(10)]
    return prompts, params


def _lm(device: str, dtype: torch.dtype):
    lm = trained_pair().lm
    return dataclasses.replace(lm, model=copy.deepcopy(lm.model).to(device, dtype))


def _proposer(method: str, device: str, dtype: torch.dtype):
    # the draft model is the target itself: every draft should be accepted, which checks its K/V end to end
    return NgramProposer(5, 3) if method == "ngram" else DraftModelProposer(_lm(device, dtype), 4)


def _run(method: str, device: str, dtype: torch.dtype, **kw):
    prompts, params = _workload()
    llm = LLM.from_loaded(_lm(device, dtype), _proposer(method, device, dtype),
                          engine=EngineConfig(max_num_seqs=8, block_size=8, **kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.acceptance_lengths) for o in outs], llm.engine.stats()


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_cuda_fp32_proposer_graph_equals_eager_and_cpu(method):
    cpu, _ = _run(method, "cpu", torch.float32)
    graph, stats = _run(method, "cuda", torch.float32)
    assert len(stats.cuda_graphs) >= 2  # several buckets were captured and replayed
    eager, eager_stats = _run(method, "cuda", torch.float32, enforce_eager=True)
    assert not eager_stats.cuda_graphs and eager_stats.num_decode_steps
    assert graph == eager == cpu
    assert max(max(a) for _, a in cpu if a) > 3  # real acceptance


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_cuda_bf16_proposer_graph_equals_eager(method):
    graph, _ = _run(method, "cuda", torch.bfloat16)
    eager, _ = _run(method, "cuda", torch.bfloat16, enforce_eager=True)
    assert graph == eager
