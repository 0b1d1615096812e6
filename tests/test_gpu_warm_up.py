"""One-shot timing on the GPU (issue 54, item 4): LLM.warm_up captures the graph of every draft length the live
policy may run at batch 1 before the timed decode, so the decode captures nothing; the live policy moving K on the
GPU keeps the outputs of plain decoding (run on the GPU machine; skipped where CUDA is absent)."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from blockspec.speculative.draft_len import LiveDraftLen
from test_gpu import _on_cuda
from trained_pair import CYCLE_A, cycle_seq, trained_pair

pytestmark = pytest.mark.gpu


def test_warm_up_captures_every_draft_length_before_the_decode():
    lm, draft = _on_cuda(trained_pair(), torch.float32)
    prompt = cycle_seq(CYCLE_A, 1, 9)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=1)).generate([prompt], params,
                                                                                   use_tqdm=False)[0]
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=1, draft_len_schedule="off"))
    live = LiveDraftLen({1: {0: 1.0, 1: 1.3, 3: 1.5, 5: 1.8}}, [0.6, 0.4, 0.3, 0.2, 0.1],
                        max_k=draft.spec.num_draft_tokens, window=4, probe_every=3)
    llm.engine.set_draft_len_policy(live, None)
    assert llm.warm_up(prompt, params) > 0
    captured = set(llm.engine.stats().cuda_graphs)
    assert len(captured) >= 4  # K = 0, 1, 3, 5 at batch 1
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert set(llm.engine.stats().cuda_graphs) == captured  # nothing captured inside the decode
    assert out.token_ids == plain.token_ids
    assert sum(live.used.values()) > 0 and not set(live.used) - {0, 1, 3, 5}
