"""The timing protocol of eval-draft and bench (blockspec/evaluation/throughput.py) on CPU: one-time costs injected
where the GPU pays them (a kernel compiled for each new prefill length, process-wide; a CUDA graph captured for each
new (bucket, K) of an engine's decode step) fall in the untimed warm-ups, never inside a timed run, whichever mode runs
first; the runs alternate; bench's report says what prompts it timed."""

from __future__ import annotations

import json
import time

import pytest

import blockspec.evaluation.throughput as throughput
from blockspec.cli import main
from blockspec.engine.decode_step import DecodeStep
from blockspec.engine.model_runner import ModelRunner
from blockspec.evaluation.eval_draft import evaluate_draft
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from trained_pair import CYCLE_A, cycle_seq, trained_pair

COST_S = 0.2  # each injected one-time cost


class OneTimeCosts:
    """Sleeps on the first prefill of each length (process-wide) and the first decode step of each (engine, bucket,
    K), recording when each sleep ran; and records when each timed generate (the one given `timed`) ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, timed: list[list[int]]) -> None:
        self.sleeps: list[tuple[str, float, float]] = []
        self.timed: list[tuple[float, float]] = []
        self.lengths: set[int] = set()  # the prefill lengths compiled for
        lengths = self.lengths
        varlen, forward, generate = ModelRunner.varlen_step, DecodeStep.forward, LLM.generate

        def sleep(kind: str) -> None:
            t = time.perf_counter()
            time.sleep(COST_S)
            self.sleeps.append((kind, t, time.perf_counter()))

        def varlen_step(runner, scheduled):
            new = {s.num_rows for s in scheduled if s.is_prefill} - lengths
            if new:
                lengths.update(new)
                sleep("compile")
            return varlen(runner, scheduled)

        def decode_forward(step, buf, rows, next_k):  # every decode step, launched from the host or chained (overlap)
            graphs = step.__dict__.setdefault("test_graphs", set())  # this engine's "captured" (bucket, K + 1, K')
            key = (*buf.input_ids.shape, next_k)
            if key not in graphs:
                graphs.add(key)
                sleep("capture")
            return forward(step, buf, rows, next_k)

        def timed_generate(llm, prompts, *a, **k):
            t = time.perf_counter()
            try:
                return generate(llm, prompts, *a, **k)
            finally:
                if prompts is timed:
                    self.timed.append((t, time.perf_counter()))

        monkeypatch.setattr(ModelRunner, "varlen_step", varlen_step)
        monkeypatch.setattr(DecodeStep, "forward", decode_forward)
        monkeypatch.setattr(LLM, "generate", timed_generate)

    def inside_timing(self) -> list[tuple[str, float, float]]:
        return [s for s in self.sleeps if any(t0 < s[2] and s[1] < t1 for t0, t1 in self.timed)]


def prompts() -> list[list[int]]:
    """6 prompts of 6 lengths: with 4 at a time, admissions next to decoding requests and a drain through the
    buckets 4, 2 and 1."""
    return [cycle_seq(CYCLE_A, i, 9 + 3 * i) for i in range(6)]


@pytest.mark.parametrize("first", ["plain", "spec"])
def test_one_time_costs_land_in_neither_timing(monkeypatch, first):
    pair = trained_pair()
    timed = prompts()
    costs = OneTimeCosts(monkeypatch, timed)
    report = evaluate_draft(pair.lm, pair.draft, timed, SamplingParams(max_tokens=24), "cycles", max_num_seqs=4,
                            use_tqdm=False, repeats=2, first=first)
    second = "spec" if first == "plain" else "plain"
    assert report.timing_order == [first, second, second, first]
    assert len(costs.timed) == 4 and len(report.runs_time_s) == len(report.baseline_runs_time_s) == 2
    assert costs.inside_timing() == []
    # the costs were paid: for every prompt length, and for each engine's buckets (4 engines: 2 runs x 2 modes)
    assert {len(p) for p in timed} <= costs.lengths
    assert [kind for kind, _, _ in costs.sleeps].count("capture") == 4 * 3
    assert max(report.runs_time_s + report.baseline_runs_time_s) < COST_S * 10  # no timed run waited on them
    assert report.outputs_identical is True and report.mean_acceptance_length > 1.5


def test_run_order_alternates_and_rejects_bad_values():
    assert throughput.run_order("plain", 3) == ["plain", "spec", "spec", "plain", "plain", "spec"]
    assert throughput.run_order("spec", 1) == ["spec", "plain"]
    assert throughput.run_order("spec", 2, speculative=False) == ["plain", "plain"]
    with pytest.raises(throughput.BlockspecError, match=r"^--repeats must be >= 1, got 0$"):
        throughput.run_order("plain", 0)
    with pytest.raises(throughput.BlockspecError, match=r"^--first must be one of plain, spec, got 'x'$"):
        throughput.run_order("x", 1)


def test_stand_ins_start_with_a_token_that_starts_no_timed_prompt():
    timed = [[0, 5, 6], [1, 7], [3, 5, 6, 8]]
    assert throughput.stand_ins(timed, 64) == [[2, 5, 6], [2, 7], [2, 5, 6, 8]]


def test_warm_batch_sizes_reach_every_bucket_and_schedule_key():
    from blockspec.config import EngineConfig

    assert throughput.warm_batch_sizes(EngineConfig(max_num_seqs=16), 164) == [1, 2, 4, 8, 16]
    assert throughput.warm_batch_sizes(EngineConfig(max_num_seqs=16), 5) == [1, 2, 4, 5]
    config = EngineConfig(max_num_seqs=70, draft_len_schedule={1: 7, 12: 3})
    assert throughput.warm_batch_sizes(config, 100) == [1, 2, 4, 8, 12, 16, 32, 64, 70]


def test_bench_defaults_to_humaneval_and_labels_random_prompts(tmp_path, capsys, monkeypatch):
    pair = trained_pair()
    target = str(pair.lm.source.path)
    seen: list[list[list[int]]] = []
    bench = throughput.bench
    monkeypatch.setattr(throughput, "bench", lambda lm, d, p, *a, **k: seen.append(p) or bench(lm, d, p, *a, **k))
    base = ["bench", "--model", target, "--num-prompts", "2", "--max-tokens", "4", "--device", "cpu", "--repeats", "1"]
    # the trained pair's target has no tokenizer: the default set cannot be encoded, and the error says what to do
    assert main(base) == 2
    assert capsys.readouterr().err == (f"blockspec: error: {pair.lm.source.name} has no tokenizer to encode humaneval "
                                       f"prompts: pass --prompts random\n")
    assert main(base + ["--prompt-len", "5"]) == 0  # --prompt-len alone: random prompts, as bench always took
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("prompts: 2 RANDOM-TOKEN prompts of 5 tokens (synthetic: tau and speedup overstate "
                                   "real text)")
    assert out.splitlines()[-1] == "run order: plain (each run on an engine warmed up first)"
    assert main(base + ["--prompts", "random", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == {"set": "random", "random_tokens": True, "num_prompts": 2, "prompt_len": 64}
    assert report["timing"] == {"order": ["plain"]} and report["plain"]["runs_time_s"] == [report["plain"]["time_s"]]
    assert [len(p) for p in seen[-1]] == [64, 64]
    assert main(base + ["--prompts", "mbpp", "--prompt-len", "5"]) == 2
    assert capsys.readouterr().err == ("blockspec: error: --prompt-len is the length of --prompts random prompts; mbpp "
                                       "prompts keep their own\n")
