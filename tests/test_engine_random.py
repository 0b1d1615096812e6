"""Randomized engine runs (hypothesis draws a seed, bounded and derandomized; the scenario is built from it with
random.Random so the mix of cases is controlled, and printed on failure): requests arrive at random steps, some
are aborted (while waiting, prefilling or decoding), with stop tokens, greedy or seeded sampling, with or without
the trained DFlash drafter, per-request speculate on/off, small pools (preemption), small token budgets (chunked
prefill, truncated verify blocks), short max_model_len (drafts capped at the context end), prefix caching.

Invariants:
- after every step: every block's reference count equals the number of live block tables holding it, the free list
  is exactly the unheld blocks, only cached blocks are shared;
- at the end: nothing leaked or double-freed (num_free == num_blocks, all reference counts 0, no request left);
- every request gets exactly one final output, streamed deltas add up to it; non-aborted requests finish with
  "stop" (last token is a stop id, no earlier one) or "length" (exactly max_tokens, capped by max_model_len);
- greedy requests equal plain `generate` (aborted ones: a prefix of it); seeded sampled requests without
  speculation equal plain `generate` with the same seed (one noise draw per token, as the reference);
- speculative requests: the first token comes from the prefill, every other from a verify step.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from blockspec.config import EngineConfig
from blockspec.errors import BlockspecError
from oracles import generate
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from engine_utils import check_block_accounting
from trained_pair import CYCLE_A, CYCLE_B, MAX_POSITIONS, VOCAB, cycle_seq, trained_pair

K = 7  # the trained drafter's block size 8 - 1


@pytest.fixture(scope="module")
def pair():
    p = trained_pair()
    assert p.draft.spec.num_draft_tokens == K
    return p


@dataclasses.dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    speculate: bool
    arrival: int  # engine step before which it is added
    abort_at: int | None  # engine step before which it is aborted (>= arrival), None: never


@dataclasses.dataclass
class Scenario:
    use_draft: bool
    block_size: int
    max_num_seqs: int
    budget: int
    max_model_len: int | None
    prefix_caching: bool
    pool_slack: float | None  # pool = blocks for the largest single request x (1 + slack); None: for all
    reqs: list[Req]

    @property
    def model_len(self) -> int:
        return min(self.max_model_len or MAX_POSITIONS, MAX_POSITIONS)


BASES = [cycle_seq(CYCLE_A, 4, 40), [3, 50, 21, 7, 44, 12, 60, 9] + cycle_seq(CYCLE_B, 0, 32)]


def random_prompt(rng: random.Random, max_len: int) -> list[int]:
    kind = rng.choice(["cycle", "shared", "random", "mixed"])
    n = rng.randint(1, max_len)
    if kind == "cycle":
        return cycle_seq(rng.choice([CYCLE_A, CYCLE_B]), rng.randrange(20), n)
    if kind == "shared":  # long common prefixes: prefix-cache hits across requests
        base = rng.choice(BASES)
        k = rng.randint(1, min(n, len(base)))
        return base[:k] + [rng.randrange(VOCAB) for _ in range(n - k)]
    if kind == "random":
        return [rng.randrange(VOCAB) for _ in range(n)]
    head = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
    return (head + cycle_seq(CYCLE_A, rng.randrange(20), n))[:n]


def random_request(rng: random.Random, model_len: int) -> Req:
    greedy = rng.random() < 0.5
    params = SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.6, 1.0, 1.5]),
        top_k=0 if greedy else rng.choice([0, 5]),
        top_p=1.0 if greedy else rng.choice([1.0, 0.9]),
        seed=None if greedy else rng.randrange(2**31),
        max_tokens=rng.randint(1, 24) if rng.random() < 0.5 else rng.randint(12, 24),
        # cycle tokens as stops: they land inside accepted runs
        stop_token_ids=rng.sample(range(10, 50), rng.choice([1, 2])) if rng.random() < 0.4 else [],
        ignore_eos=rng.random() < 0.5,
    )
    arrival = rng.randint(0, 3) if rng.random() < 0.7 else rng.randint(0, 10)
    abort_at = arrival + rng.randint(0, 8) if rng.random() < 0.2 else None
    return Req(random_prompt(rng, min(48, model_len - 1)), params, rng.random() < 0.85, arrival, abort_at)


def random_scenario(seed: int, prefix_caching: bool | None = None) -> Scenario:
    rng = random.Random(seed)
    if prefix_caching is None:
        caching = rng.random() < 0.4
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        slack = rng.choice([None, 0.0, 0.0, 0.5, 1.0, 4.0])
    else:
        caching, block_size, slack = True, rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([0.0, 0.5, 1.0])
    max_model_len = rng.choice([None, None, 40, 64])
    mml = min(max_model_len or MAX_POSITIONS, MAX_POSITIONS)
    return Scenario(
        use_draft=rng.random() < 0.75, block_size=block_size, max_num_seqs=rng.randint(1, 8),
        budget=rng.randint(4, 80), max_model_len=max_model_len, prefix_caching=caching, pool_slack=slack,
        reqs=[random_request(rng, mml) for _ in range(rng.randint(3, 10))],
    )


def max_new(sc: Scenario, r: Req) -> int:
    return min(r.params.max_tokens, sc.model_len - len(r.prompt))


def pool_blocks(sc: Scenario) -> int:
    """Enough for the largest request alone (prompt + outputs + a full verify window) times (1 + slack): preemption;
    or with slack None enough for every request at once: never preempts."""
    need = [math.ceil((len(r.prompt) + max_new(sc, r) + K + 1) / sc.block_size) + 1 for r in sc.reqs]
    return max(2, sum(need) if sc.pool_slack is None else int(max(need) * (1 + sc.pool_slack)))


_refs: dict = {}


def plain(lm, prompt: list[int], params: SamplingParams):
    key = (tuple(prompt), repr(params))
    if key not in _refs:
        out = generate(lm, prompt, params)
        _refs[key] = (out.token_ids, out.finish_reason)
    return _refs[key]


def run_scenario(pair, sc: Scenario):
    """Runs the scenario, checks every invariant, returns the engine."""
    lm = pair.lm
    llm = LLM.from_loaded(lm, pair.draft if sc.use_draft else None,
                          engine=EngineConfig(block_size=sc.block_size, max_num_seqs=sc.max_num_seqs,
                                              max_num_batched_tokens=sc.budget, num_kv_blocks=pool_blocks(sc),
                                              max_model_len=sc.max_model_len, enable_prefix_caching=sc.prefix_caching))
    engine = llm.engine
    ids: dict[int, str] = {}
    aborted: set[int] = set()
    final, streamed = {}, {}

    def collect(outs):
        for o in outs:
            assert o.request_id not in final, f"{o.request_id}: output after the final one"
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.token_ids == streamed[o.request_id]
            if o.finished:
                final[o.request_id] = o

    step = 0
    while len(ids) < len(sc.reqs) or engine.has_unfinished():
        for i, r in enumerate(sc.reqs):
            if r.arrival == step or (r.arrival < step and i not in ids):
                ids[i] = engine.add_request(r.prompt, r.params, speculate=r.speculate)
        for i, r in enumerate(sc.reqs):
            if r.abort_at == step and i in ids:
                engine.abort(ids[i])
                aborted.add(i)
        collect(engine.step())
        check_block_accounting(engine)
        step += 1
        assert step < 1500, "the engine does not make progress"
    collect(engine.step())  # hands back requests aborted after the last step
    engine.abort("no-such-request")  # unknown / already finished ids are ignored
    for rid in ids.values():
        engine.abort(rid)
    assert engine.step() == []

    # nothing leaked, nothing freed twice
    bm = engine.blocks
    assert not engine.has_unfinished()
    assert bm.num_free == engine.pool.num_blocks and all(r == 0 for r in bm.ref)
    assert not engine.seqs
    assert set(final) == set(ids.values()), "every request gets exactly one final output"

    for i, r in enumerate(sc.reqs):
        o = final[ids[i]]
        stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(lm.stop_token_ids))
        toks, cap = o.token_ids, max_new(sc, r)
        assert o.finished and o.prompt_ids == r.prompt
        assert all(0 <= t < VOCAB for t in toks)
        assert len(toks) <= cap
        assert not any(t in stops for t in toks[:-1]), "generation went on past a stop token"
        if o.finish_reason == "stop":
            assert toks and toks[-1] in stops
        elif o.finish_reason == "length":
            assert len(toks) == cap and (not toks or toks[-1] not in stops)
        else:
            assert o.finish_reason == "abort" and i in aborted, (i, o.finish_reason)
        spec = sc.use_draft and r.speculate
        if spec and toks:
            assert sum(o.acceptance_lengths) == len(toks) - 1
            assert all(a <= st.num_accepted + 1 <= K + 1 for a, st in zip(o.acceptance_lengths, o.steps))
        elif not spec:
            assert set(o.acceptance_lengths) <= {1}
        ref_params = dataclasses.replace(r.params, max_tokens=cap)
        if r.params.greedy or not spec:  # greedy, or one seeded noise draw per token like the reference
            ref, reason = plain(lm, r.prompt, ref_params)
            if o.finish_reason == "abort":
                assert toks == ref[: len(toks)]
            else:
                assert (toks, o.finish_reason) == (ref, reason), (i, r)
    if not currently_in_test_context():
        return engine
    # what this example exercised (pytest --hypothesis-show-statistics)
    event(f"requests: {len(sc.reqs)}, steps: {'<20' if step < 20 else '<60' if step < 60 else '>=60'}")
    event(f"preempted: {engine.scheduler.num_preemptions > 0}")
    event(f"prefix hits: {engine.blocks.prefix_hits > 0}")
    event(f"aborted: {sum(final[ids[i]].finish_reason == 'abort' for i in aborted) > 0}")
    event(f"stopped: {any(o.finish_reason == 'stop' for o in final.values())}")
    event(f"drafts accepted: {any(a > 1 for o in final.values() for a in o.acceptance_lengths)}")
    return engine


# no shrinking: a seed does not shrink meaningfully, and a failing scenario is printed whole (note)
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=40, **SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_engine_runs(pair, seed):
    sc = random_scenario(seed)
    note(repr(sc))
    run_scenario(pair, sc)


@settings(max_examples=25, **SETTINGS)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_engine_runs_prefix_cache_small_pools(pair, seed):
    sc = random_scenario(seed, prefix_caching=True)
    note(repr(sc))
    run_scenario(pair, sc)


def test_random_scenario_covers_the_interesting_paths(pair):
    """A fixed busy scenario: preemption, aborts of waiting and running requests, stops, sampling, speculate off."""
    reqs = []
    for i in range(12):
        prompt = BASES[i % 2][: 10 + 3 * i] if i % 3 else cycle_seq(CYCLE_B, i, 5 + i)
        params = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[44] if i == 4 else [],
                                temperature=0.0 if i % 4 else 1.0, seed=i)
        reqs.append(Req(prompt, params, i != 7, i // 3, {2: 0, 5: 3, 9: 6}.get(i)))
    sc = Scenario(True, 1, 6, 32, None, False, 0.5, reqs)
    engine = run_scenario(pair, sc)
    assert engine.scheduler.num_preemptions > 0


def test_abort_and_request_ids(pair):
    llm = LLM.from_loaded(pair.lm, pair.draft, engine=EngineConfig(block_size=4, max_num_seqs=1))
    e = llm.engine
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    a = e.add_request(cycle_seq(CYCLE_A, 0, 9), sp, request_id="a")
    b = e.add_request(cycle_seq(CYCLE_A, 3, 9), sp)  # waits: max_num_seqs=1
    with pytest.raises(BlockspecError, match="already in use"):
        e.add_request([1, 2], sp, request_id="a")
    e.step()
    e.abort(b)  # still waiting
    e.abort(b)  # twice: ignored
    outs = e.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(b, "abort")]
    e.abort(a)  # decoding
    outs = e.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(a, "abort")]
    ref = generate(pair.lm, cycle_seq(CYCLE_A, 0, 9), sp).token_ids
    assert outs[0].token_ids and outs[0].token_ids == ref[: len(outs[0].token_ids)]
    assert not e.has_unfinished() and e.blocks.num_free == e.pool.num_blocks
    # a finished id can be used again
    e.add_request([5, 6, 7], sp, request_id="a")
    while e.has_unfinished():
        e.step()
    assert e.blocks.num_free == e.pool.num_blocks and all(r == 0 for r in e.blocks.ref)
