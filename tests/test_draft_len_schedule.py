"""The draft length schedule (speculative/schedule.py): the K per batch size that emits the most tokens per second
from measured step costs and per-position acceptance, K = 0 where no draft pays; the table a drafter directory
carries per device and the engine's default from it; outputs unchanged whatever K each step drafts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import ConfigError
from blockspec.evaluation.throughput import bench as run_bench
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.sampling import SamplingParams
from blockspec.speculative.schedule import (SCHEDULE_FILE, derive_schedule, device_key, expected_tokens,
                                            install_schedule, load_schedule)
from blockspec.train.export import save_draft
from tool_utils import ROOT
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

CPU = torch.device("cpu")
PER_POSITION = [0.8, 0.6, 0.5, 0.3, 0.2, 0.1, 0.05]


def test_expected_tokens_counts_the_bonus_and_accepted_drafts():
    assert expected_tokens(PER_POSITION, 0) == 1.0
    assert expected_tokens(PER_POSITION, 3) == pytest.approx(2.9)
    assert expected_tokens(PER_POSITION, 7) == pytest.approx(3.55)


def test_derive_schedule_takes_the_most_tokens_per_second():
    costs = {1: {0: 1.0, 3: 1.2, 7: 1.5},  # 1, 2.42, 2.37 tokens per unit: K = 3
             8: {0: 1.0, 3: 1.1, 7: 1.2},  # 1, 2.64, 2.96: K = 7
             64: {0: 1.0, 3: 3.5, 7: 4.0},  # 1, 0.83, 0.89: no draft pays, K = 0
             128: {0: 1.0, 2: 2.4, 3: 2.9}}  # 1, 1.0, 1.0: a tie goes to the smallest K
    assert derive_schedule(costs, PER_POSITION) == {1: 3, 8: 7, 64: 0, 128: 0}
    # a K past the measured positions has no known worth and is not taken, however cheap
    assert derive_schedule({1: {0: 1.0, 2: 1.0, 9: 0.1}}, PER_POSITION[:2]) == {1: 2}
    with pytest.raises(ConfigError, match=r"^draft length costs at batch 4: no K in 0\.\.2 \(measured \[5, 9\]\)$"):
        derive_schedule({4: {5: 1.0, 9: 1.0}}, PER_POSITION[:2])


def test_schedule_file_keeps_each_devices_table(tmp_path):
    assert load_schedule(tmp_path, CPU) is None
    install_schedule(tmp_path, CPU, {"schedule": {"1": 5, "16": 2, "64": 0}, "command": "x"})
    tables = json.loads((tmp_path / SCHEDULE_FILE).read_text())
    tables["NVIDIA H200"] = {"schedule": {"1": 15}}
    (tmp_path / SCHEDULE_FILE).write_text(json.dumps(tables))
    install_schedule(tmp_path, CPU, {"schedule": {"1": 4}})  # re-measured here: the other device's entry stays
    assert load_schedule(tmp_path, CPU) == {1: 4}
    assert json.loads((tmp_path / SCHEDULE_FILE).read_text())["NVIDIA H200"] == {"schedule": {"1": 15}}
    assert device_key(CPU) == "cpu"
    (tmp_path / SCHEDULE_FILE).write_text('{"cpu": {"schedule": [1, 2]}}')
    with pytest.raises(ConfigError, match=rf"^{tmp_path / SCHEDULE_FILE}: not a draft length schedule file"):
        load_schedule(tmp_path, CPU)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    pair = trained_pair()
    config = json.loads((Path(pair.lm.source.path).parent / "draft" / "config.json").read_text())
    return save_draft(pair.draft.model, config, tmp_path_factory.mktemp("schedule") / "draft", dtype=torch.float32)


def test_the_engine_drafts_as_the_drafters_schedule_says_with_unchanged_output(draft_dir, tmp_path):
    """A drafter directory with a CPU table: the engine's default schedule (an explicit one wins); 4 requests of
    different lengths decode with K = 0 while 3 or more run and K = 3 after, and emit plain decoding's tokens."""
    pair = trained_pair()
    lm = pair.lm
    directory = tmp_path / "draft"
    shutil.copytree(draft_dir, directory)
    install_schedule(directory, CPU, {"schedule": {"1": 3, "3": 0}})
    draft = load_draft(SpeculativeConfig(draft_model=str(directory), num_draft_tokens=5), lm)
    given = LLM.from_loaded(lm, draft, engine=EngineConfig(draft_len_schedule={1: 2}))
    assert given.engine.config.draft_len_schedule == {1: 2}
    off = LLM.from_loaded(lm, draft, engine=EngineConfig(draft_len_schedule="off"))
    assert off.engine.config.draft_len_schedule is None  # K throughout
    spec = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4))
    assert spec.engine.config.draft_len_schedule == {1: 3, 3: 0}
    prompts = [cycle_seq(CYCLE_A, 0, 6), cycle_seq(CYCLE_B, 2, 9), cycle_seq(CYCLE_A, 3, 5), [3, 50, 21, 7, 44]]
    params = [SamplingParams(max_tokens=n) for n in (8, 16, 30, 40)]
    plain = LLM.from_loaded(lm, None,
                            engine=EngineConfig(max_num_seqs=4, block_size=4)).generate(prompts, params, use_tqdm=False)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    longest = outs[3].acceptance_lengths
    assert longest[0] == 1 and max(longest) > 2  # no drafts among 4 requests, accepted drafts once alone
    default = LLM.from_loaded(lm, load_draft(SpeculativeConfig(draft_model=str(draft_dir)), lm))
    assert default.engine.config.draft_len_schedule is None  # a directory without the file: as before
    report = run_bench(lm, draft, prompts[:2], params[:2], repeats=1, engine=EngineConfig(max_num_seqs=4, block_size=4))
    assert report["spec"]["draft_len_schedule"] == {1: 3, 3: 0}  # the report says which draft lengths it ran
    assert report["plain"]["draft_len_schedule"] is None


def test_the_benchmark_measures_costs_and_acceptance(draft_dir, monkeypatch):
    """benchmarks/draft_len_schedule.py's parts on the trained pair: per-position acceptance (non-increasing: a
    draft is accepted only after every draft before it) and a positive cost per (batch, K)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import draft_len_schedule as bench

    pair = trained_pair()
    lm = pair.lm
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=3), lm)
    prompts = [cycle_seq(CYCLE_A, 0, 6), cycle_seq(CYCLE_B, 2, 9)]
    per_position = bench.per_position_acceptance(lm, draft, prompts, 24, 3)
    assert len(per_position) == 3 and per_position == sorted(per_position, reverse=True) and per_position[0] > 0.5
    assert all(0.0 < bench.step_seconds(lm, draft, batch, k, context=8, steps=12) < 5.0
               for batch, k in [(1, 0), (2, 3)])
