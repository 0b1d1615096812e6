"""The static-shape decode step (engine/decode_step.py): it is really taken, it gives the same outputs as the varlen
step, its padding rows never write the pool, and with the counter-based noise a seeded request emits the same
tokens with and without speculation (each emitted token is the target's sample at its position)."""

from __future__ import annotations

import random

import pytest

from blockspec.config import EngineConfig
from blockspec.engine.decode_step import buckets
from oracles import generate
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from path_log import PathLog
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair


@pytest.fixture(scope="module")
def pair():
    p = trained_pair()
    return p.lm, p.draft


def workload(n: int, seed: int, max_tokens: tuple[int, int] = (10, 40)):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append(cycle_seq((CYCLE_A, CYCLE_B)[i % 2], rng.randrange(20), rng.randint(1, 60)))
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=rng.randint(*max_tokens), ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=rng.choice([0.6, 1.0, 1.5]), top_k=rng.choice([0, 5]),
                                         top_p=rng.choice([1.0, 0.9]), seed=1000 + i,
                                         max_tokens=rng.randint(*max_tokens), ignore_eos=True))
    return prompts, params


def run(llm: LLM, prompts, params, speculate: bool = True):
    return [(o.token_ids, o.acceptance_lengths, o.steps)
            for o in llm.generate(prompts, params, use_tqdm=False, speculate=speculate)]


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(32) == [1, 2, 4, 8, 16, 32]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_decode_step_taken_and_equal_to_varlen_step(pair):
    lm, draft = pair
    prompts, params = workload(12, seed=1, max_tokens=(30, 90))
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=7, block_size=4))
    log = PathLog()  # steps are launched from the host's inputs, or chained from the last step
    llm.engine.observe(log)
    fused = run(llm, prompts, params)
    calls = [(b, k) for path, b, k in log.calls if path == "decode"]
    assert len(calls) >= 8 and any(b > 1 for b, _ in calls) and any(b not in buckets(7) for b, _ in calls), calls
    varlen = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=7, block_size=4, step_path="varlen"))
    assert run(varlen, prompts, params) == fused
    assert varlen.engine.stats().num_decode_steps == 0 and varlen.engine.stats().num_varlen_steps > 0
    assert sum(len(acc) for _, acc, _ in fused) > 0 and max(max(acc) for _, acc, _ in fused if acc) > 3


def test_mixed_steps_split_and_keep_outputs(pair):
    """split_mixed_steps: a step that admits or prefills requests next to decoding ones runs the decoding ones
    through the decode step and only the rest through the varlen step. Outputs, acceptance lengths and step traces
    equal the unsplit engine's, sampled requests included."""
    lm, draft = pair
    prompts, params = workload(14, seed=2, max_tokens=(20, 70))
    kw = dict(max_num_seqs=6, block_size=4, max_num_batched_tokens=48)
    plain = LLM.from_loaded(lm, draft, engine=EngineConfig(**kw))
    assert not plain.engine.config.split_mixed_steps  # the default
    split = LLM.from_loaded(lm, draft, engine=EngineConfig(split_mixed_steps=True, **kw))
    log, scheduled = PathLog(), []  # per step: the paths it took; how many requests it scheduled
    split.engine.observe(log)
    real_schedule = split.engine.scheduler.schedule

    def schedule():
        out = real_schedule()
        if out:  # a step is launched
            scheduled.append(len(out))
        return out

    split.engine.scheduler.schedule = schedule
    assert run(split, prompts, params) == run(plain, prompts, params)
    steps = [s for s in log.steps if s]  # the engine schedules every step it launches (no overlap on the CPU)
    assert len(steps) == len(scheduled)
    mixed = [(n, [c[:2] for c in calls]) for n, calls in zip(scheduled, steps) if len(calls) == 2]
    assert len(mixed) >= 3, mixed
    assert all(n == calls[0][1] + calls[1][1] and calls[0][0] == "decode" for n, calls in mixed), mixed
    assert any(calls[0][1] > 1 for _, calls in mixed), mixed


def test_padding_rows_never_write_the_pool(pair):
    lm, draft = pair
    # one step at a time (with overlap, eng.step() would also enqueue the next step, which writes its own window)
    llm = LLM.from_loaded(lm, draft,
                          engine=EngineConfig(max_num_seqs=4, block_size=4, enable_prefix_caching=False, overlap=False))
    eng = llm.engine
    for i in range(3):  # 3 requests run in the bucket of 4: one padding row, whose block table is all block 0
        eng.add_request(cycle_seq(CYCLE_A, i, 9), SamplingParams(max_tokens=30, ignore_eos=True))
    while any(s.in_prefill for s in eng.scheduler.running) or len(eng.scheduler.running) < 3:
        eng.step()
    pool = eng.pool
    before = [t.clone() for t in (pool.k, pool.v, pool.draft_k, pool.draft_v)]
    seqs = list(eng.scheduler.running)
    windows = [(s, s.num_computed, s.drafts.k + 1) for s in seqs]  # the verify rows of this step
    log = PathLog()
    eng.observe(log)
    eng.step()
    assert [c[:2] for c in log.calls] == [("decode", 3)]  # the decode step, in its bucket of 4
    written = {s.block_table[p // 4] * 4 + p % 4 for s, start, n in windows for p in range(start, start + n)}
    for old, new in zip(before, (pool.k, pool.v, pool.draft_k, pool.draft_v)):
        changed = set((old != new).flatten(2).any(-1).any(0).nonzero().flatten().tolist())
        assert changed and changed <= written, sorted(changed - written)


@pytest.mark.parametrize("probabilistic", [False, True])
def test_seeded_sampling_spec_equals_plain(pair, probabilistic):
    lm, draft = pair
    prompts, params = workload(8, seed=2)
    plain = [generate(lm, p, sp).token_ids for p, sp in zip(prompts, params)]
    if probabilistic:  # p/q acceptance: distribution-exact, but not the same draws as plain decoding
        import dataclasses

        draft = dataclasses.replace(draft, spec=dataclasses.replace(draft.spec, probabilistic_drafting=True))
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4))
    spec = [t for t, _, _ in run(llm, prompts, params)]
    engine_plain = [t for t, _, _ in run(llm, prompts, params, speculate=False)]
    single = [spec_generate(lm, draft, p, sp).token_ids for p, sp in zip(prompts, params)]
    assert engine_plain == plain
    assert spec == single  # the engine and the single-request loop use the same noise
    if not probabilistic:
        assert spec == plain  # argmax drafts: every emitted token is the target's own seeded sample
    else:
        sampled = [i for i, sp in enumerate(params) if not sp.greedy]
        assert any(spec[i] != plain[i] for i in sampled)
        assert all(spec[i] == plain[i] for i, sp in enumerate(params) if sp.greedy)


def test_probabilistic_drafting_runs_in_the_decode_step(pair):
    """Sampled drafts (probabilistic drafting) take the decode step like argmax drafts: their q stays on the device
    between the step that draws them and the step that accepts them, also when that step is chained (overlap).
    Outputs, acceptance lengths and traces equal the varlen-only engine's."""
    import dataclasses

    lm, draft = pair
    draft = dataclasses.replace(draft, spec=dataclasses.replace(draft.spec, probabilistic_drafting=True))
    prompts, params = workload(10, seed=5, max_tokens=(20, 50))
    # overlap as on CUDA: chained steps carry q from one step to the next on the device
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4, overlap=True))
    log = PathLog()  # decode steps launched from the host or chained
    llm.engine.observe(log)
    fused = run(llm, prompts, params)
    sampled_rows = [sum(not s.seq.params.greedy for s in sch) for path, sch in log.requests if path == "decode"]
    assert sum(sampled_rows) > 20 and llm.engine.num_overlapped_steps > 0, sampled_rows
    varlen = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4, step_path="varlen"))
    assert run(varlen, prompts, params) == fused
    single = [spec_generate(lm, draft, p, sp).token_ids for p, sp in zip(prompts, params)]
    assert [t for t, _, _ in fused] == single


def test_cpu_never_captures(pair):
    lm, draft = pair
    llm = LLM.from_loaded(lm, draft)
    llm.generate([cycle_seq(CYCLE_A, 0, 9)], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_decode_steps > 0 and not stats.cuda_graphs


def test_a_failing_request_fails_alone(pair):
    lm, draft = pair
    prompts, params = workload(6, seed=3)
    want = run(LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4)), prompts, params)
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4))
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    victim = eng.seqs[ids[2]]

    def broken(*a, **k):
        raise RuntimeError("injected")

    victim.stats.record = broken  # this request's bookkeeping raises on its first verify step
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert final[ids[2]].finish_reason == "error" and final[ids[2]].error == "RuntimeError: injected"
    for i in (0, 1, 3, 4, 5):
        o = final[ids[i]]
        assert (o.token_ids, o.acceptance_lengths, o.steps) == want[i] and o.error is None
    assert eng.blocks.num_free == eng.pool.num_blocks and not eng.seqs
