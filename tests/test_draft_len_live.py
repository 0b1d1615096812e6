"""The live draft length policy (speculative/draft_len.py): K re-picked from the acceptance the engine sees, with a
margin over K = 0 and probes while it drafts nothing; the engine's outputs are unchanged when K moves step to step;
an explicit num_draft_tokens means K throughout."""

from __future__ import annotations

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine.calibrate import Calibration
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.sampling import SamplingParams
from blockspec.speculative.draft_len import FixedDraftLen, LiveDraftLen
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

# a CPU-like cost table: the first draft pays the draft pass, each further one a verify row
COSTS = {1: {0: 7.0, 1: 12.0, 2: 14.5, 3: 16.5}, 4: {0: 12.0, 1: 30.0, 2: 40.0, 3: 50.0}}
HIGH = [0.9, 0.8, 0.7]


def test_no_observations_keep_the_prior_and_pick_its_best():
    live = LiveDraftLen(COSTS, HIGH, max_k=3)
    assert live.per_position(1) == pytest.approx(HIGH)
    assert live.k(1) == 3  # (1 + 2.4) / 16.5 beats 1 / 7 by far
    assert live.k(4) == 0 and live.k(16) == 0  # the batch-4 costs never pay at this acceptance (largest key <= 16)
    assert live.k(2) == 3  # batch 2 reads batch 1's entry


def test_rejected_drafts_turn_drafting_off_and_accepted_ones_back_on():
    live = LiveDraftLen(COSTS, HIGH, max_k=3, probe_every=5, probe_budget=1.0)
    for _ in range(20):
        live.observe(1, 3, 0)
    assert live.next_k(1) == 0
    assert live.per_position(1)[0] < 0.2
    ks = [live.next_k(1) for _ in range(10)]
    assert ks.count(0) == 8 and all(k > 0 for k in (ks[3], ks[8]))  # a probe every 5 steps at K = 0
    for _ in range(64):  # the probes see every draft accepted: the window forgets the rejections
        live.observe(1, 3, 3)
    assert live.next_k(1) == 3
    assert live.used[0] == 9 and live.used[3] == 1  # the probes drafted the K the low estimate rated best (1)


def test_probes_cost_at_most_their_budget_and_never_where_nothing_could_pay():
    live = LiveDraftLen({1: {0: 10.0, 1: 17.0}, 32: {0: 10.0, 1: 50.0}}, [0.9], max_k=1)
    for batch in (1, 32):
        for _ in range(20):
            live.observe(batch, 1, 0)
    assert live._probe_interval(1, 1) == pytest.approx(35.0)  # a probe costs 0.7 extra plain steps: 1 in 35
    assert live._probe_interval(32, 1) == float("inf")  # 2 tokens for 5 steps' cost: no acceptance could pay
    assert [live.next_k(32) for _ in range(300)].count(1) == 0
    assert [live.next_k(1) for _ in range(300)].count(1) == 8


def test_a_k_that_only_breaks_even_is_not_chosen():
    # tokens per step at K = 1 with p_1 = 0.75: 1.75 / 12 = 0.1458 vs 1 / 7 = 0.1429: +2 %, under the 10 % margin
    live = LiveDraftLen({1: {0: 7.0, 1: 12.0}}, [0.75], max_k=1)
    assert live.k(1) == 0
    assert LiveDraftLen({1: {0: 7.0, 1: 12.0}}, [0.75], max_k=1, margin=0.0).k(1) == 1


def test_hysteresis_keeps_the_current_k_between_near_equal_rates():
    costs = {1: {0: 10.0, 2: 12.0, 3: 14.0}}
    live = LiveDraftLen(costs, [0.9, 0.8, 0.5], max_k=3)
    assert live.k(1) == 3  # 3.2 / 14 = 0.229 beats 2.7 / 12 = 0.225 from nothing...
    live.buckets[1].k, live.buckets[1].stale = 2, True
    assert live.k(1) == 2  # ...but not by 3 % over a K already running
    for _ in range(64):
        live.observe(1, 3, 3)
    assert live.k(1) == 3


def test_positions_not_tried_keep_the_priors_shape():
    live = LiveDraftLen({1: {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}}, [0.8, 0.4, 0.2], max_k=3, prior_weight=1e-9)
    for _ in range(50):
        live.observe(1, 1, 1)  # position 1 always accepted, positions 2 and 3 never tried
    p = live.per_position(1)
    assert p[0] == pytest.approx(1.0) and p[1] == pytest.approx(0.5) and p[2] == pytest.approx(0.25)


def test_fixed_draft_len_is_the_schedule():
    fixed = FixedDraftLen({1: 3, 8: 1}, max_k=4)
    assert [fixed.k(b) for b in (1, 4, 8, 64)] == [3, 3, 1, 1]
    assert FixedDraftLen(None, max_k=4).k(16) == 4


def test_calibration_gives_the_live_policy_only_with_costs_and_acceptance():
    cal = Calibration({1: 3}, "measured", "cpu", HIGH, COSTS)
    assert isinstance(cal.policy(3), LiveDraftLen) and "re-picked from the live acceptance" in cal.describe()
    bare = Calibration({1: 3}, "drafter", "cpu")
    assert isinstance(bare.policy(3), FixedDraftLen) and "live" not in bare.describe()


def test_engine_outputs_equal_plain_while_k_moves(monkeypatch):
    """Greedy outputs of the engine under a live policy that changes K step to step (costs made so that every
    acceptance level is near a switch) equal plain decoding's, on the decode and varlen paths."""
    pair = trained_pair()
    prompts = [cycle_seq(CYCLE_A, 0, 6), cycle_seq(CYCLE_B, 2, 9), cycle_seq(CYCLE_A, 7, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM.from_loaded(pair.lm, None, engine=EngineConfig(max_num_seqs=3)).generate(prompts, params,
                                                                                         use_tqdm=False)
    draft = load_draft(SpeculativeConfig(draft_model=str(pair.lm.source.path.parent / "draft"),
                                         num_draft_tokens=4), pair.lm)
    for path in ("auto", "varlen"):
        llm = LLM.from_loaded(pair.lm, draft, engine=EngineConfig(max_num_seqs=3, step_path=path,
                                                                   draft_len_schedule="off"))
        costs = {1: {0: 1.0, 1: 1.6, 2: 1.9, 3: 2.3, 4: 2.6}}
        live = LiveDraftLen(costs, [0.5, 0.3, 0.2, 0.1], max_k=4, window=6, probe_every=3, probe_budget=1.0)
        llm.engine.set_draft_len_policy(live, None)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert len(live.used) >= 2, live.used  # K did move


def test_an_explicit_k_means_k(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path))
    pair = trained_pair()
    draft_dir = str(pair.lm.source.path.parent / "draft")
    llm = LLM(str(pair.lm.source.path), speculative={"draft_model": draft_dir, "num_draft_tokens": 3},
              engine=EngineConfig(max_num_seqs=2))
    assert llm.calibration is None and llm.engine.config.draft_len_schedule is None and llm.engine.K == 3
    assert llm.engine.draft_len.k(1) == 3 and llm.engine.draft_len.k(2) == 3
    assert not list(tmp_path.rglob("*.json"))  # nothing was calibrated


@pytest.mark.parametrize("path", ["auto", "varlen"])
def test_context_kept_at_k0_drafts_as_appending_every_step(path):
    """On the CPU, rows of steps that propose nothing are kept and appended before the next propose: the drafts
    (so every step's accepted count, and the K the live policy picks from them) equal those of a drafter that appends
    every step, with slots reused by later requests (5 prompts, 2 at a time)."""
    pair = trained_pair()
    prompts = [cycle_seq(CYCLE_A, 0, 6), cycle_seq(CYCLE_B, 2, 9), cycle_seq(CYCLE_A, 7, 8), cycle_seq(CYCLE_B, 1, 5),
               cycle_seq(CYCLE_A, 3, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 25, 33, 40, 18)]
    runs = []
    for defer in (False, True):
        draft = load_draft(SpeculativeConfig(draft_model=str(pair.lm.source.path.parent / "draft"),
                                             num_draft_tokens=4), pair.lm)
        llm = LLM.from_loaded(pair.lm, draft, engine=EngineConfig(max_num_seqs=2, step_path=path,
                                                                   draft_len_schedule="off"))
        proposer = llm.engine.proposer
        assert proposer.defer_context  # the CPU default
        proposer.defer_context = defer
        flushed = []
        flush = proposer.flush_context
        proposer.flush_context = lambda models: (flushed.append(proposer._num_deferred), flush(models))[1]
        live = LiveDraftLen({1: {0: 1.0, 1: 1.6, 2: 1.9, 3: 2.3, 4: 2.6}}, [0.3, 0.2, 0.1, 0.05], max_k=4,
                            window=4, probe_every=3, probe_budget=1.0)
        llm.engine.set_draft_len_policy(live, None)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(([o.token_ids for o in outs], [o.acceptance_lengths for o in outs], dict(live.used)))
        assert (max(flushed) > 1) == defer  # rows were kept over K = 0 steps only when deferring
    assert runs[0] == runs[1]
    assert 0 in runs[0][2] and len(runs[0][2]) >= 2, runs[0][2]  # K = 0 steps and drafting ones both ran
