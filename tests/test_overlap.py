"""Overlap scheduling (EngineConfig.overlap, `--no-overlap`): the engine enqueues decode step n+1 from step n's
device-side result before reading step n's tokens. Outputs, acceptance lengths and step traces equal the synchronous
engine's: staggered arrivals, preemption in a tight pool, prefix-cache hits, seeded sampling, a draft-length schedule,
aborts, and plain decoding; and the overlapped path is really taken."""

from __future__ import annotations

import random

import pytest

from blockspec.config import EngineConfig
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from engine_utils import Run, assert_equal_plain, spec_consistency
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair


@pytest.fixture(scope="module")
def pair():
    p = trained_pair()
    return p.lm, p.draft


def workload(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded-sampled requests; every third prompt shares a 24-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = cycle_seq(CYCLE_B, 3, 24)
    prompts, params = [], []
    for i in range(n):
        p = cycle_seq((CYCLE_A, CYCLE_B)[i % 2], rng.randrange(20), rng.randint(2, 40))
        prompts.append(shared + p[:5] if i % 3 == 0 else p)
        if i % 2 == 0:
            params.append(SamplingParams(max_tokens=rng.randint(10, 60), ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=rng.choice([0.7, 1.2]), top_k=rng.choice([0, 8]), seed=50 + i,
                                         max_tokens=rng.randint(10, 60), ignore_eos=True))
    return prompts, params


def run(llm: LLM, prompts, params, stagger: int | None = 2):
    outs = Run(llm).run(prompts, params, stagger=stagger)
    spec_consistency([o for o in outs if o.acceptance_lengths])  # each trace holds the drafts its step verified
    return [(o.token_ids, o.finish_reason, o.acceptance_lengths, list(map(repr, o.steps))) for o in outs]


@pytest.mark.parametrize("engine", [
    dict(max_num_seqs=5, block_size=4),
    dict(max_num_seqs=6, block_size=4, num_kv_blocks=40),  # tight: requests are preempted and recomputed
    dict(max_num_seqs=4, block_size=8, draft_len_schedule={1: 7, 3: 3}),
    dict(max_num_seqs=5, block_size=4, split_mixed_steps=True),
])
def test_overlap_equals_synchronous(pair, engine):
    lm, draft = pair
    prompts, params = workload(12, seed=len(engine))
    on = LLM.from_loaded(lm, draft, engine=EngineConfig(overlap=True, **engine))  # the CUDA behaviour on the CPU
    off = LLM.from_loaded(lm, draft, engine=EngineConfig(overlap=False, **engine))
    got, want = run(on, prompts, params), run(off, prompts, params)
    if "draft_len_schedule" in engine:
        # a step enqueued just before a request finishes keeps the K of the larger batch for that one step, where
        # the synchronous engine redrafts with the schedule's K: the same tokens, other acceptance lengths (each
        # trace still consistent: run() checks)
        got, want = [g[:2] for g in got], [w[:2] for w in want]
    assert got == want
    assert on.engine.num_overlapped_steps > 3 and off.engine.num_overlapped_steps == 0
    assert on.engine.inflight is None  # nothing left enqueued once every request finished
    if "num_kv_blocks" in engine:
        assert on.engine.scheduler.num_preemptions > 0 and off.engine.scheduler.num_preemptions > 0
    assert on.engine.blocks.prefix_hits > 0
    greedy = [i for i, sp in enumerate(params) if sp.greedy]
    assert_equal_plain(lm, [prompts[i] for i in greedy], [params[i] for i in greedy],
                       [on.generate([prompts[i]], params[i], use_tqdm=False)[0] for i in greedy])


def test_overlap_plain_decoding(pair):
    lm, draft = pair
    prompts, params = workload(8, seed=3)
    on = LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=4, overlap=True))
    off = LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=4))
    assert run(on, prompts, params, stagger=None) == run(off, prompts, params, stagger=None)
    assert on.engine.num_overlapped_steps > 10, on.engine.num_overlapped_steps
    stats = off.engine.stats()
    assert stats.num_overlapped_steps == 0 and stats.num_decode_steps > 10  # the CPU default: decode steps, none chained


def test_abort_while_a_step_is_enqueued(pair):
    """A request aborted while its next step is in flight gets no tokens from that step; the others go on as if
    it had never run beside them."""
    lm, draft = pair
    prompts, params = workload(3, seed=5)
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, overlap=True))
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.inflight is None:
        eng.step()
    done_before = len(eng.seqs[ids[1]].output_ids)
    eng.abort(ids[1])
    outs = {o.request_id: o for o in eng.step()}
    assert outs[ids[1]].finished and len(outs[ids[1]].token_ids) == done_before
    rest = {}
    while eng.has_unfinished():
        rest.update((o.request_id, o) for o in eng.step() if o.finished)
    alone = LLM.from_loaded(lm, draft, engine=EngineConfig(overlap=False)).generate(
        [prompts[0], prompts[2]], [params[0], params[2]], use_tqdm=False)
    assert [rest[ids[0]].token_ids, rest[ids[2]].token_ids] == [o.token_ids for o in alone]

