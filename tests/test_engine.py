"""The batched engine (continuous batching, chunked prefill, paged KV shared by target and draft context, prefix
cache, preemption) against the single-request references, in fp32 on CPU with tiny models.

- Greedy outputs of a batch equal per-request plain `generate`, token for token, for 32 requests of mixed prompt
  (1..300) and output lengths, arriving at once or staggered, KV block sizes 1/3/16, chunked prefill forced by a small
  token budget, with no drafter, a random drafter and a trained drafter (acceptance > 1 inside a batch).
- With DFlash, per-request acceptance lengths and step traces equal the single-request `spec_generate`.
- Preemption (pool too small) and prefix-cache hits leave outputs and acceptance lengths unchanged.
"""

from __future__ import annotations

import pytest

from blockspec.config import EngineConfig
from blockspec.llm import LLM
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

from engine_utils import (
    Run, assert_equal_plain, assert_equal_spec, assert_pool_empty, cycle_workload, greedy,
    plain_ref, spec_consistency, spec_ref,
)
from engine_utils import tiny, trained, workload  # noqa: F401 - fixtures, used by name

# --------------------------------------------------------------------------------------------------------------
# 1. batched greedy == per-request greedy


BUDGET = {1: 24, 3: 40, 16: 64}


@pytest.mark.parametrize("stagger", [None, 3], ids=["at-once", "staggered"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "dflash-random"])
def test_batched_greedy_equals_plain(tiny, workload, with_draft, block_size, stagger):
    lm, draft = tiny
    prompts, params = workload
    llm = LLM.from_loaded(lm, draft if with_draft else None,
                          engine=EngineConfig(block_size=block_size, max_num_seqs=32,
                                              max_num_batched_tokens=BUDGET[block_size],
                                              num_kv_blocks=7000 // block_size))
    run = Run(llm)
    outs = run.run(prompts, params, stagger=stagger)
    assert_equal_plain(lm, prompts, params, outs)
    assert run.max_running >= 4  # it really batched
    if with_draft:
        spec_consistency(outs)
        assert all(o.acceptance_lengths or len(o.token_ids) == 1 for o in outs)
    else:  # no drafter: every decode step emits exactly one token
        assert all(set(o.acceptance_lengths) <= {1} for o in outs)
        assert all(not st["draft"] for o in outs for st in o.steps)
    assert llm.engine.scheduler.num_preemptions == 0


CACHE_PARAMS = [pytest.param(False, id="no-prefix-cache"), pytest.param(True, id="prefix-cache")]


@pytest.mark.parametrize("prefix_caching", CACHE_PARAMS)
@pytest.mark.parametrize("stagger", [None, 2], ids=["at-once", "staggered"])
def test_trained_drafter_accepts_inside_a_batch_with_chunked_prefill(trained, stagger, prefix_caching):
    """Tiny token budget (decodes are truncated and prefill is chunked), trained drafter: still lossless, and several
    requests accept long runs in the same step. The cycle prompts share blocks, so the prefix cache hits."""
    lm, draft = trained
    prompts, params = cycle_workload(16, seed=1)
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(block_size=4, max_num_seqs=16, max_num_batched_tokens=24,
                                              num_kv_blocks=1200, enable_prefix_caching=prefix_caching))
    run = Run(llm)
    outs = run.run(prompts, params, stagger=stagger)
    assert_equal_plain(lm, prompts, params, outs)
    spec_consistency(outs)
    assert run.batch_accept >= 3, run.batch_accept
    taus = [o.mean_acceptance_length for o in outs if o.acceptance_lengths]
    assert sum(taus) / len(taus) > 2.0, taus


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_acceptance_lengths_equal_single_request_spec(trained, block_size):
    """When the budget never truncates a verify block (max_num_seqs x (K+1) <= budget), every request's acceptance
    lengths and step trace equal the single-request reference loop; prefill is still chunked (budget 40)."""
    lm, draft = trained
    prompts, params = cycle_workload(12, seed=2)
    K = draft.spec.num_draft_tokens
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(block_size=block_size, max_num_seqs=4,
                                              max_num_batched_tokens=4 * (K + 1) + 8, num_kv_blocks=4000 // block_size))
    outs = Run(llm).run(prompts, params, stagger=1)
    assert_equal_spec(lm, draft, prompts, params, outs)
    assert_equal_plain(lm, prompts, params, outs)
    assert max(max(o.acceptance_lengths) for o in outs) == K + 1


def test_stream_deltas_and_generate_order(tiny, workload):
    lm, draft = tiny
    prompts, params = workload[0][:8], workload[1][:8]
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(block_size=8, max_num_batched_tokens=48, enable_prefix_caching=False))
    got: dict[str, list[int]] = {}
    finals = {}
    for o in llm.stream(prompts, params):
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            finals[o.request_id] = o
    assert len(finals) == 8 and all(got[r] == o.token_ids for r, o in finals.items())
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_equal_plain(lm, prompts, params, outs)
    assert_pool_empty(llm.engine)


# --------------------------------------------------------------------------------------------------------------
# 2. preemption


@pytest.mark.parametrize("prefix_caching", CACHE_PARAMS)
@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "dflash-random"])
def test_preemption_keeps_outputs(tiny, workload, with_draft, prefix_caching):
    """Recomputing a preempted request restores its own committed blocks from the prefix cache when it is on."""
    lm, draft = tiny
    prompts, params = workload
    # the largest request needs ceil((300 + 24 + 8) / 4) = 83 blocks; all 32 together need far more than 100
    llm = LLM.from_loaded(lm, draft if with_draft else None,
                          engine=EngineConfig(block_size=4, max_num_seqs=32, max_num_batched_tokens=64,
                                              num_kv_blocks=100, enable_prefix_caching=prefix_caching))
    outs = Run(llm).run(prompts, params, stagger=4)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    assert_equal_plain(lm, prompts, params, outs)
    if with_draft:
        spec_consistency(outs)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_acceptance_lengths(trained, prefix_caching):
    """Preempted requests are recomputed and continue with the same drafts (the pool is so tight that their freed
    blocks are reused at once: no prefix hits here even with the cache on)."""
    lm, draft = trained
    prompts, params = cycle_workload(10, seed=3, max_len=60, max_tokens=(30, 60))
    K = draft.spec.num_draft_tokens
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(block_size=4, max_num_seqs=6, max_num_batched_tokens=6 * (K + 1),
                                              num_kv_blocks=60, enable_prefix_caching=prefix_caching))
    outs = Run(llm).run(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_equal_spec(lm, draft, prompts, params, outs)


# --------------------------------------------------------------------------------------------------------------
# 3. prefix cache


def test_prefix_cache_hit_keeps_outputs_and_acceptance(trained):
    lm, draft = trained
    prefix = cycle_seq(CYCLE_A, 3, 41)
    a = prefix + cycle_seq(CYCLE_A, 44, 3)
    b = prefix + cycle_seq(CYCLE_A, 44, 7)  # shares 41 tokens (5 full blocks) with a
    sp = greedy(32, ignore_eos=True)
    cached = LLM.from_loaded(lm, draft, engine=EngineConfig(block_size=8, max_num_batched_tokens=256))
    plain = LLM.from_loaded(lm, draft,
                            engine=EngineConfig(block_size=8, max_num_batched_tokens=256, enable_prefix_caching=False))
    bm = cached.engine.blocks

    first = cached.generate([a], sp, use_tqdm=False)[0]
    hits = bm.prefix_hits
    second = cached.generate([b], sp, use_tqdm=False)[0]
    assert bm.prefix_hits - hits >= 41 // 8  # every full block of the shared prefix came from the cache
    # a's own generated tokens are cached too: continuing a's full text hits blocks written by verify steps
    hits = bm.prefix_hits
    cont = a + first.token_ids
    third = cached.generate([cont], sp, use_tqdm=False)[0]
    assert bm.prefix_hits - hits >= (len(cont) - 1) // 8 - 1
    again = cached.generate([a], sp, use_tqdm=False)[0]  # the very same prompt again

    for prompt, out in [(a, first), (b, second), (cont, third), (a, again)]:
        ref = plain.generate([prompt], sp, use_tqdm=False)[0]
        assert out.token_ids == ref.token_ids == plain_ref(lm, prompt, sp)[0]
        assert out.acceptance_lengths == ref.acceptance_lengths == spec_ref(lm, draft, prompt, sp)[2]
        assert out.mean_acceptance_length > 2.5, out.acceptance_lengths  # the drafts are meaningful
    assert plain.engine.blocks.prefix_hits == 0
    assert_pool_empty(cached.engine)
    assert_pool_empty(plain.engine)


def test_prefix_shared_with_a_running_request(trained):
    """b arrives while a (same long prefix) is still decoding: b maps a's committed blocks (ref count 2)."""
    lm, draft = trained
    prefix = cycle_seq(CYCLE_B, 5, 64)
    a, b = prefix + [CYCLE_B[9]], prefix + cycle_seq(CYCLE_B, 9, 6)
    sp = greedy(48, ignore_eos=True)
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(block_size=4, max_num_batched_tokens=96))
    run = Run(llm)
    ra = run.add(a, sp)
    run.step()
    run.step()
    hits = llm.engine.blocks.prefix_hits
    rb = run.add(b, sp)
    run.step()  # check_block_accounting sees the shared blocks held twice, each a cached block
    assert llm.engine.blocks.prefix_hits - hits >= 64 // 4
    assert max(llm.engine.blocks.ref) == 2
    while llm.engine.has_unfinished():
        run.step()
    assert_pool_empty(llm.engine)
    assert_equal_spec(lm, draft, [a, b], [sp, sp], [run.final[ra], run.final[rb]])


@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "dflash-random"])
def test_min_admit_groups_admissions_and_keeps_outputs(tiny, workload, with_draft):
    """min_admit=4 (offline throughput): while requests decode, waiting ones join only 4 at a time (or all that
    remain), and outputs are unchanged."""
    lm, draft = tiny
    prompts, params = workload
    llm = LLM.from_loaded(lm, draft if with_draft else None,
                          engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=4096, num_kv_blocks=600,
                                              min_admit=4))
    sched = llm.engine.scheduler
    joined: list[tuple[int, int, int]] = []  # (running before, admitted, waiting before) of steps that admitted
    real = sched.schedule

    def schedule():
        before, waiting = len(sched.running), len(sched.waiting)
        out = real()
        admitted = sum(1 for s in out if s.is_prefill and s.seq.num_computed == 0)
        if admitted:
            joined.append((before, admitted, waiting))
        return out

    sched.schedule = schedule
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_equal_plain(lm, prompts, params, [o for o in outs])
    later = [(b, a, w) for b, a, w in joined if b > 0]
    assert later, joined  # some admissions happened while others were decoding
    assert all(a >= min(4, w) for _, a, w in later), later
