"""`blockspec eval-draft` on a tiny trained target + drafter (tests/trained_pair.py) given a word-level tokenizer and a
chat template: the JSON report's acceptance numbers equal those of the single-request reference loop
(the dense oracle, tests/oracles.py) on the same templated prompts, outputs equal plain greedy decoding, and the PNG is written;
`blockspec bench` on the same pair times the chat-templated prompts of a shipped evaluation set."""

from __future__ import annotations

import json
import shutil
import statistics
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch

import blockspec.loading.bundled_draft as bundled_draft
from blockspec.cli import main
from blockspec.config import SpeculativeConfig
from blockspec.data.eval_prompts import load_eval_prompts
from oracles import generate
from blockspec.layers import cpu_packed
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.models.dflash import DFlashDraftModel
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from blockspec.train.export import save_draft
from dflash_utils import needs_bf16
from blockspec.speculative.schedule import SCHEDULE_FILE, device_key
from trained_pair import BLOCK, CYCLE_A, VOCAB, trained_pair

KEYS = {"dataset", "num_prompts", "mean_acceptance_length", "per_position_acceptance", "tokens_per_second",
        "baseline_tokens_per_second", "speedup"}
LIMIT, MAX_TOKENS = 4, 40


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """The trained pair on disk: the target with a tokenizer whose chat template ends in the start of a learned cycle
    (so the drafter has something to predict after any prompt), and the trained drafter."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pair = trained_pair()
    root = tmp_path_factory.mktemp("eval_pair")
    target = Path(shutil.copytree(pair.lm.source.path, root / "target"))
    config = json.loads((Path(pair.lm.source.path).parent / "draft" / "config.json").read_text())
    draft = save_draft(pair.draft.model, config, root / "draft", dtype=torch.float32)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB - 1)}}  # VOCAB - 1: the mask
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    start = " ".join(f"t{t}" for t in CYCLE_A[:5])
    fast.chat_template = ("{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
                          "{% if add_generation_prompt %} " + start + "{% endif %}")
    fast.save_pretrained(str(target))
    return target, draft


def eval_draft(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["eval-draft", "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_eval_draft_json_matches_reference_loop(pair_dirs, tmp_path, capsys):
    target, draft_dir = pair_dirs
    rc, out, err = eval_draft(capsys, "--model", str(target), "--draft", str(draft_dir), "--dataset", "mtbench",
                              "--limit", str(LIMIT), "--max-tokens", str(MAX_TOKENS), "--out-dir", str(tmp_path),
                              "--json")
    assert rc == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert KEYS <= set(report)
    assert report["dataset"] == "mtbench" and report["num_prompts"] == LIMIT and report["outputs_identical"] is True
    assert report["differing_outputs"] == []
    assert json.loads((tmp_path / "mtbench-report.json").read_text()) == report

    # the same prompts through the reference loops, one request at a time
    lm = load_model(str(target), LoadConfig(device="cpu"))
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir)), lm)
    k = draft.spec.num_draft_tokens
    params = SamplingParams(max_tokens=MAX_TOKENS)
    lens, accepted, tokens, per_prompt = [], [], 0, []
    for text in load_eval_prompts("mtbench", LIMIT):
        ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        ref = spec_generate(lm, draft, ids, params)
        assert ref.token_ids == generate(lm, ids, params).token_ids
        lens += ref.acceptance_lengths
        per_prompt.append(sum(ref.acceptance_lengths) / len(ref.acceptance_lengths))
        accepted += [s.num_accepted for s in ref.steps]
        tokens += len(ref.token_ids)
    assert report["num_draft_tokens"] == k and report["num_verify_steps"] == len(lens)
    assert report["generated_tokens"] == report["baseline_generated_tokens"] == tokens
    assert report["mean_acceptance_length"] == pytest.approx(sum(lens) / len(lens))
    assert report["per_prompt_acceptance"] == pytest.approx(per_prompt, abs=1e-4)
    assert report["per_position_acceptance"] == pytest.approx([sum(a >= i for a in accepted) / len(accepted)
                                                               for i in range(1, k + 1)])
    counts = Counter(lens)
    assert report["acceptance_histogram"] == [counts[n] for n in range(1, k + 2)]
    assert report["mean_acceptance_length"] > 1.5  # the drafter predicts the cycle (measured 1.81)
    assert report["speedup"] == pytest.approx(report["tokens_per_second"] / report["baseline_tokens_per_second"])
    # timed twice per mode, alternating, on warmed engines: the medians, each run, and the range they span
    assert report["timing_order"] == ["plain", "spec", "spec", "plain"]
    assert report["time_s"] == pytest.approx(statistics.median(report["runs_time_s"]))
    assert report["baseline_time_s"] == pytest.approx(statistics.median(report["baseline_runs_time_s"]))
    assert len(report["runs_time_s"]) == len(report["baseline_runs_time_s"]) == 2
    lo, hi = report["speedup_range"]
    assert lo <= report["speedup"] <= hi and report["time_spread"] >= 0 and report["baseline_time_spread"] >= 0

    png = Path(report["png"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1100, 400)  # figsize 11 x 4 inches at 100 dpi


def test_eval_draft_table(pair_dirs, tmp_path, capsys):
    target, draft_dir = pair_dirs
    rc, out, err = eval_draft(capsys, "--model", str(target), "--draft", str(draft_dir), "--dataset", "gsm8k",
                              "--limit", "2", "--max-tokens", "8", "--num-draft-tokens", "3",
                              "--out-dir", str(tmp_path), "--repeats", "1", "--first", "spec")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "eval-draft gsm8k: 2 prompts, max 8 new tokens, temperature 0.0, K=3, batch 1"
    assert lines[-2] == "outputs identical to no-spec: True"
    (speedup,) = [line for line in lines if line.startswith("speedup: ")]
    assert speedup.endswith("x (one run each, warmed up: spec no-spec)")
    report = json.loads((tmp_path / "gsm8k-report.json").read_text())
    assert report["timing_order"] == ["spec", "plain"] and len(report["runs_time_s"]) == 1
    assert lines[-1] == f"acceptance plot: {tmp_path}/gsm8k-acceptance.png   report: {tmp_path}/gsm8k-report.json"
    assert (tmp_path / "gsm8k-acceptance.png").is_file()


def test_eval_draft_drafts_k_throughout_whatever_the_drafters_table(pair_dirs, tmp_path, capsys):
    """A drafter's recorded draft-length table for this device (K = 0 here: plain steps) does not enter eval-draft:
    the report is the drafter's acceptance at K, step for step the same as without the table."""
    target, draft_dir = pair_dirs
    tabled = Path(shutil.copytree(draft_dir, tmp_path / "tabled"))
    (tabled / SCHEDULE_FILE).write_text(json.dumps({device_key(torch.device("cpu")): {"schedule": {"1": 0}}}))
    reports = []
    for d in (draft_dir, tabled):
        rc, out, err = eval_draft(capsys, "--model", str(target), "--draft", str(d), "--dataset", "mtbench",
                                  "--limit", "2", "--max-tokens", str(MAX_TOKENS), "--repeats", "1",
                                  "--out-dir", str(tmp_path / d.name), "--json")
        assert rc == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    plain, with_table = reports
    assert with_table["acceptance_histogram"] == plain["acceptance_histogram"]
    assert with_table["mean_acceptance_length"] == plain["mean_acceptance_length"] > 1.5


def test_divergences_name_each_differing_prompt():
    from blockspec.cli.evaluate import _differing
    from blockspec.evaluation.eval_draft import divergences

    spec, plain = [[1, 2, 3], [4, 5, 6], [7, 8], [9]], [[1, 2, 3], [4, 0, 6], [7, 8, 2], [9]]
    rows = divergences(spec, plain)
    assert rows == [{"prompt": 1, "first_divergence": 1}, {"prompt": 2, "first_divergence": 2}]
    assert _differing(rows) == " (2 prompts differ, first at tokens 1, 2)" and _differing([]) == ""


def test_rounding_hint_only_for_differing_gpu_runs_without_batch_invariance():
    from blockspec.cli.evaluate import _rounding_hint

    hint = "\n  (verify rows and plain decode rows round differently here; --batch-invariant makes them equal)"
    assert _rounding_hint({"outputs_identical": False, "device": "cuda", "batch_invariant": False}) == hint
    assert _rounding_hint({"outputs_identical": False, "device": "cuda", "batch_invariant": True}) == ""
    assert _rounding_hint({"outputs_identical": False, "device": "cpu", "batch_invariant": False}) == ""
    assert _rounding_hint({"outputs_identical": True, "device": "cuda", "batch_invariant": False}) == ""
    assert _rounding_hint({"outputs_identical": None, "device": "cuda", "batch_invariant": False}) == ""


def test_eval_draft_errors(pair_dirs, tmp_path, capsys, monkeypatch):
    target, _ = pair_dirs
    rc, _, err = eval_draft(capsys, "--model", str(target), "--dataset", "mbpp")
    assert rc == 2
    assert err == "blockspec: error: --model needs --draft (the bundled drafter is for the bundled target only)\n"
    monkeypatch.setattr(bundled_draft, "BUNDLED_DRAFT_DIR", tmp_path / "absent")
    rc, _, err = eval_draft(capsys, "--dataset", "humaneval")
    assert rc == 2
    assert err == (f"blockspec: error: the bundled SmolLM2-135M-Instruct DFlash drafter is not available: "
                   f"{tmp_path}/absent lacks config.json and model.safetensors. Pass a drafter with --draft DIR "
                   f"(e.g. one trained with `blockspec train-draft`)\n")


def test_eval_draft_full_block_drafting_matches_reference(pair_dirs, tmp_path, capsys, monkeypatch):
    target, draft_dir = pair_dirs
    rows: list[int] = []  # rows of every draft block the engine ran
    forward = DFlashDraftModel.forward
    monkeypatch.setattr(DFlashDraftModel, "forward", lambda self, embeds, *a, **k: rows.append(embeds.shape[0]) or
                        forward(self, embeds, *a, **k))
    rc, out, err = eval_draft(capsys, "--model", str(target), "--draft", str(draft_dir), "--dataset", "mtbench",
                              "--limit", str(LIMIT), "--max-tokens", str(MAX_TOKENS), "--num-draft-tokens", "2",
                              "--full-block-drafting", "--out-dir", str(tmp_path), "--json")
    assert rc == 0, err
    # the flag reaches the engine: every spec step drafted the trained block (8 rows), not K + 1 = 3
    assert rows and set(rows) == {BLOCK}
    monkeypatch.setattr(DFlashDraftModel, "forward", forward)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["full_block_drafting"] is True and report["outputs_identical"] is True
    lm = load_model(str(target), LoadConfig(device="cpu"))
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=2, full_block_drafting=True), lm)
    lens: list[int] = []
    for text in load_eval_prompts("mtbench", LIMIT):
        ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        lens += spec_generate(lm, draft, ids, SamplingParams(max_tokens=MAX_TOKENS)).acceptance_lengths
    assert report["num_verify_steps"] == len(lens)
    assert report["mean_acceptance_length"] == pytest.approx(sum(lens) / len(lens))
    table = _table_header(report)
    assert table == (f"eval-draft mtbench: {LIMIT} prompts, max {MAX_TOKENS} new tokens, temperature 0.0, K=2 "
                     "(full-block drafting), batch 1")


@needs_bf16
def test_eval_draft_cpu_bf16_draft_and_draft_vocab(pair_dirs, tmp_path, capsys, monkeypatch):
    """--cpu-packed --cpu-bf16-draft --draft-vocab-size reach the target and the drafter: outputs still equal plain
    decoding, and the report and its table say what ran."""
    target, draft_dir = pair_dirs
    packed = []
    monkeypatch.setattr(cpu_packed, "pack_target", lambda m, f=cpu_packed.pack_target: packed.append(m) or f(m))
    rc, out, err = eval_draft(capsys, "--model", str(target), "--draft", str(draft_dir), "--dataset", "mtbench",
                              "--limit", "2", "--max-tokens", "24", "--num-draft-tokens", "3", "--cpu-bf16-draft",
                              "--draft-vocab-size", "40", "--cpu-packed", "--out-dir", str(tmp_path), "--json")
    assert rc == 0, err
    assert len(packed) == 1  # the target eval-draft decoded with was packed
    report = json.loads(out.strip().splitlines()[-1])
    assert report["outputs_identical"] is True and report["mean_acceptance_length"] > 1.5
    assert report["cpu_bf16_draft"] is True and report["draft_vocab_size"] == 40 and report["cpu_packed"] is True
    assert _table_header(report) == ("eval-draft mtbench: 2 prompts, max 24 new tokens, temperature 0.0, K=3 "
                                     "(packed CPU target, bf16 CPU drafter, draft vocab 40), batch 1")


def _table_header(report: dict) -> str:
    from blockspec.cli.evaluate import _table

    return _table(report).splitlines()[0]


def test_bench_times_the_first_humaneval_prompts_with_the_chat_template(pair_dirs, capsys, monkeypatch):
    import blockspec.evaluation.throughput as throughput

    target, draft_dir = pair_dirs
    timed: list[list[list[int]]] = []
    bench = throughput.bench
    monkeypatch.setattr(throughput, "bench", lambda lm, d, p, *a, **k: timed.append(p) or bench(lm, d, p, *a, **k))
    args = ["bench", "--model", str(target), "--draft", str(draft_dir), "--num-prompts", "3", "--max-tokens", "8",
            "--device", "cpu"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "prompts: the first 3 of humaneval (chat template)"
    assert lines[-1] == "run order: plain spec spec plain (each run on an engine warmed up first)"
    # K throughout (the tiny pair's calibrated schedule may draft nothing: drafting costs as much as its target)
    assert main(args + ["--prompts", "mtbench", "--first", "spec", "--repeats", "1", "--json",
                        "--draft-len-schedule", "off"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == {"set": "mtbench", "random_tokens": False, "num_prompts": 3, "chat_template": True}
    assert report["timing"] == {"order": ["spec", "plain"]} and report["config"]["prompts"] == "mtbench"
    assert report["outputs_identical"] is True and report["spec"]["mean_acceptance_length"] > 1.0
    tok = load_model(str(target), LoadConfig(device="cpu")).tokenizer
    assert timed == [[tok.apply_chat_template([{"role": "user", "content": text}])
                      for text in load_eval_prompts(name, 3)] for name in ("humaneval", "mtbench")]
    assert main(["bench", "--model", str(target), "--num-prompts", "165", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("blockspec: error: --num-prompts 165: humaneval has 164 prompts (repeats would "
                                       "be prefix-cache hits)\n")
