"""draft_len_schedule="auto" (engine/calibrate.py): the draft length per batch size measured on this machine, with
the engine it will serve with; cached per device, models and options; K = 0 where drafting does not pay; outputs
unchanged."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.engine import calibrate
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.sampling import SamplingParams
from blockspec.speculative.schedule import install_schedule, schedule_for_batches
from blockspec.train.export import save_draft
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

CPU = torch.device("cpu")
PROMPTS = [cycle_seq(CYCLE_A, 0, 6), cycle_seq(CYCLE_B, 2, 9), cycle_seq(CYCLE_A, 7, 8)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "MIN_RUN_S", 0.02)  # tiny models: short runs are enough to rank them
    return tmp_path / "cache" / "draft_len"


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    pair = trained_pair()
    config = json.loads((pair.lm.source.path.parent / "draft" / "config.json").read_text())
    return save_draft(pair.draft.model, config, tmp_path_factory.mktemp("calibrate") / "draft", dtype=torch.float32)


def _auto(draft, **engine) -> LLM:
    return LLM.from_loaded(trained_pair().lm, draft, engine=EngineConfig(draft_len_schedule="auto", **engine))


def test_measured_once_then_cached_and_outputs_unchanged(draft_dir, cache, monkeypatch):
    lm = trained_pair().lm
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=5), lm)
    llm = _auto(draft, max_num_seqs=4, block_size=4)
    cal = llm.calibration
    assert cal.source == "measured" and cal.seconds > 0
    assert sorted(cal.schedule) == [1, 2, 4] and all(0 <= k <= 5 for k in cal.schedule.values())
    assert llm.engine.config.draft_len_schedule == cal.schedule
    assert len(cal.per_position) == 5 and cal.per_position == sorted(cal.per_position, reverse=True)
    assert all(v > 0 for by_k in cal.step_ms.values() for v in by_k.values()) and 0 in cal.step_ms[1]
    assert len(list(cache.glob("*.json"))) == 1
    assert "draft length schedule (batch:K) 1:" in cal.describe() and "measured on" in cal.describe()

    def boom(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibrate, "measure_costs", boom)
    monkeypatch.setattr(calibrate, "measure_acceptance", boom)
    again = _auto(draft, max_num_seqs=4, block_size=4)
    assert again.calibration.source == "cached" and again.calibration.schedule == cal.schedule
    assert again.calibration.seconds == 0.0
    params = [SamplingParams(max_tokens=n) for n in (12, 20, 30)]
    plain = LLM.from_loaded(lm, None,
                            engine=EngineConfig(max_num_seqs=4, block_size=4)).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in again.generate(PROMPTS, params, use_tqdm=False)] == [o.token_ids for o in plain]
    # another K (another step cost and block shape) is another calibration
    other = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=3), lm)
    with pytest.raises(AssertionError, match="measured again"):
        _auto(other, max_num_seqs=4, block_size=4)


def test_where_no_draft_length_pays_the_engine_runs_without_the_drafter(draft_dir, monkeypatch):
    lm = trained_pair().lm
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=5), lm)
    monkeypatch.setattr(calibrate, "schedule_for_batches", lambda step_ms, per_position, batches: {b: 0 for b in batches})
    llm = _auto(draft, max_num_seqs=4, block_size=4)
    assert llm.calibration.drafts_nothing and llm.calibration.schedule == {1: 0, 2: 0, 4: 0}
    assert llm.engine.proposer is None and llm.engine.K == 0  # no context appends either
    assert llm.calibration.describe().endswith("no draft length pays here: decoding without the drafter")
    params = [SamplingParams(max_tokens=n) for n in (12, 20, 30)]
    plain = LLM.from_loaded(lm, None,
                            engine=EngineConfig(max_num_seqs=4, block_size=4)).generate(PROMPTS, params, use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(set(o.acceptance_lengths) <= {1} for o in outs)


def test_a_larger_batch_measures_only_what_the_cache_lacks(draft_dir, cache, monkeypatch):
    lm = trained_pair().lm
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=3), lm)
    first = _auto(draft, max_num_seqs=2).calibration
    asked = []
    real = calibrate.measure_costs
    monkeypatch.setattr(calibrate, "measure_costs", lambda e, p, b: asked.append(b) or real(e, p, b))
    second = _auto(draft, max_num_seqs=8).calibration
    assert {b: second.schedule[b] for b in (1, 2)} == first.schedule
    # batches 4 and 8 measured, unless a smaller batch already chose K = 0 (then nothing is)
    assert asked in ([[4, 8]], []) and (asked or first.schedule[2] == 0)
    assert sorted(second.schedule) == [1, 2, 4, 8]


def test_the_drafters_table_for_this_device_wins(draft_dir, tmp_path, cache):
    directory = tmp_path / "draft"
    shutil.copytree(draft_dir, directory)
    install_schedule(directory, CPU, {"schedule": {"1": 3, "4": 1}})
    draft = load_draft(SpeculativeConfig(draft_model=str(directory), num_draft_tokens=5), trained_pair().lm)
    cal = _auto(draft).calibration
    assert cal.source == "drafter" and cal.schedule == {1: 3, 4: 1}
    assert not cache.exists()  # nothing measured


def fake_engine(monkeypatch, cost, max_k: int):
    """An engine of drafter K = max_k for measure_costs whose decode runs are not run: a timed run of (batch, K) costs
    cost(runner, K, steps) seconds a step (runner.batch: its batch size)."""

    class FakeBatch:
        def __init__(self, engine, batch, context, room, seed):
            self.batch = batch

        def release(self):
            pass

    class Engine:
        K = max_k
        pool = type("P", (), {"num_blocks": 4096, "block_size": 16})()
        config = type("C", (), {"draft_len_schedule": None})()

        def set_draft_len_schedule(self, s):
            pass

    monkeypatch.setattr(calibrate, "_Batch", FakeBatch)
    monkeypatch.setattr(calibrate, "_warm", lambda runner, K: 4)
    monkeypatch.setattr(calibrate, "_step_seconds", cost)
    return Engine()


def test_only_draft_lengths_that_can_win_are_measured(monkeypatch):
    """Synthetic costs: a draft pass of 1 unit paid whatever K, 0.02 per verify row per request. Larger batches
    try no K above the best of the smaller one, a batch stops two draft lengths past its best, and once K = 0 wins
    nothing larger is measured."""
    per_position = [0.9, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1]
    measured = []

    def cost(runner, K, steps):
        measured.append((runner.batch, K))
        return 1.0 + 0.02 * runner.batch * (K + 1) + (0.8 if K else 0.0) * (1 + runner.batch / 8)

    costs = calibrate.measure_costs(fake_engine(monkeypatch, cost, 7), per_position, [1, 2, 4, 8, 16, 32, 64])
    schedule = schedule_for_batches({b: {k: s * 1e3 for k, s in by.items()} for b, by in costs.items()},
                                    per_position, [1, 2, 4, 8, 16, 32, 64])
    ks = [schedule[b] for b in sorted(schedule)]
    assert ks == sorted(ks, reverse=True) and ks[0] > 0 and ks[-1] == 0
    for b, by_k in costs.items():
        smaller = [c for c in costs if c < b]
        if smaller:
            assert max(by_k) <= schedule[max(smaller)]
        best = max((k for k in by_k if k), key=lambda k: calibrate.expected_tokens(per_position, k) / by_k[k])
        assert sorted(k for k in by_k if k > best) == [k for k in calibrate.DRAFT_LENS if best < k <= max(by_k)]
        assert len([k for k in by_k if k > best]) <= 2
    first_zero = min(b for b in schedule if schedule[b] == 0)
    assert all(b <= first_zero for b, _ in measured)


def test_each_k_keeps_its_fastest_run_of_rounds_taken_in_turn(monkeypatch):
    """A pause of the machine while the first Ks ran (3x slower) must not stay in their costs: every K is timed
    again in turn and keeps its fastest run."""
    calls = []

    def cost(runner, K, steps):
        calls.append(K)
        return (1.0 + 0.1 * K) * (3.0 if len(calls) <= 3 else 1.0)

    costs = calibrate.measure_costs(fake_engine(monkeypatch, cost, 3), [0.9, 0.8, 0.7], [1])
    assert calls == [0, 1, 2, 3] * calibrate.ROUNDS
    assert costs == {1: {K: pytest.approx(1.0 + 0.1 * K) for K in range(4)}}


def test_bad_schedule_value_names_the_field():
    from blockspec.config import EngineConfig
    from blockspec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^draft_len_schedule='fast': expected 'auto', 'off', None or a \{batch: K\}"):
        EngineConfig(draft_len_schedule="fast")
