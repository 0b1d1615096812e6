"""Greedy speculative decoding is lossless for any drafter (random ones included), and the CLI reports it."""

from __future__ import annotations

import json

import pytest

from blockspec.cli import main
from blockspec.config import SpeculativeConfig
from oracles import generate
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from dflash_utils import cli_pair, make_zlab_draft
from hf_utils import make_hf_model, save_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, seed=11)
    save_hf_model(hf, d / "t")
    make_zlab_draft(hf.config, d / "d", block_size=16, target_layer_ids=[0, 1, 2], scale=2.0)
    return load_model(str(d / "t"), LoadConfig(device="cpu", with_tokenizer=False)), d / "d"


@pytest.mark.parametrize("K", [1, 3, 15])
def test_greedy_spec_equals_plain(pair, K):
    lm, draft_dir = pair
    dr = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=K), lm)
    for prompt_len, max_tokens in [(1, 25), (45, 30)] if K != 3 else [(7, 20)]:
        prompt = [(13 * i + 5) % 128 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        plain = generate(lm, prompt, params)
        spec = spec_generate(lm, dr, prompt, params)
        assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "length"
        assert sum(spec.acceptance_lengths) == len(spec.token_ids) - 1  # the first token comes from prefill
        assert all(1 <= a <= K + 1 for a in spec.acceptance_lengths)
        # with the model's own stop id (eos=2) honoured
        params = SamplingParams(max_tokens=max_tokens)
        assert spec_generate(lm, dr, prompt, params).token_ids == generate(lm, prompt, params).token_ids


def test_cli_draft_json_and_trace(tmp_path, capsys):
    base = cli_pair(tmp_path)
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(tmp_path / "d"), "--num-draft-tokens", "5"]) == 0
    explicit = json.loads(capsys.readouterr().out)  # an explicit K means K throughout: nothing calibrated
    assert explicit["token_ids"] == plain["token_ids"] and explicit["draft_len_schedule"] is None
    assert set(explicit["draft_lens_used"]) <= {"0", "5"} and explicit["draft_lens_used"].get("5")
    assert main(base + ["--draft", str(tmp_path / "d"), "--num-draft-tokens", "5", "--draft-len-schedule",
                        "auto"]) == 0
    calibrated = json.loads(capsys.readouterr().out)  # the schedule measured here (K <= 5 per batch size)
    assert calibrated["token_ids"] == plain["token_ids"] and 0 <= calibrated["draft_len_schedule"]["1"] <= 5
    assert main(base + ["--draft", str(tmp_path / "d"), "--num-draft-tokens", "5", "--trace",
                        "--draft-len-schedule", "off"]) == 0  # K = 5 throughout
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain["token_ids"] and out["draft_len_schedule"] is None
    assert sum(out["acceptance_lengths"]) == out["num_generated_tokens"] - 1
    assert out["mean_acceptance_length"] == pytest.approx(sum(out["acceptance_lengths"]) / len(out["acceptance_lengths"]))
    steps = out["steps"]
    assert len(steps) == len(out["acceptance_lengths"]) and all(len(s["draft"]) == 5 for s in steps)
    assert steps[0]["position"] == 3  # the bonus sampled from the prefill sits right after the 3 prompt tokens
    for a, b, n in zip(steps, steps[1:], out["acceptance_lengths"]):
        assert b["position"] == a["position"] + n


def test_cli_draft_left_out_where_no_draft_length_pays(tmp_path, capsys, monkeypatch):
    from blockspec.engine import calibrate

    monkeypatch.setenv("BLOCKSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "schedule_for_batches", lambda step_ms, per_position, batches: {b: 0 for b in batches})
    base = cli_pair(tmp_path)
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(tmp_path / "d"), "--draft-len-schedule", "auto"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["token_ids"] == plain["token_ids"] and out["mean_acceptance_length"] == 1.0
    assert out["draft_len_schedule"] == {"1": 0} and "acceptance_lengths" not in out
    assert "no draft length pays here: decoding without the drafter" in captured.err


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit,flags,needle", [
    ({"dflash_config": None}, [], "target_layer_ids"),
    ({"dflash_config": {"target_layer_ids": [0, 1]}}, [], "mask_token_id"),
    ({"dflash_config": {"target_layer_ids": [0, 7], "mask_token_id": 5}}, [], "target_layer_ids=[0, 7]"),
    ({"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 500}}, [], "mask_token_id=500"),
    ({"hidden_size": 32}, [], "hidden_size=32"),
    ({"vocab_size": 100}, [], "vocab_size=100"),
    ({}, ["--num-draft-tokens", "8"], "num_draft_tokens=8"),
    ({"architectures": ["Qwen3ForCausalLM"]}, ["--speculative-method", "dflash"], "not a DFlash draft"),
    # without a method, a plain causal LM is a classic draft model, which needs K
    ({"architectures": ["Qwen3ForCausalLM"]}, [], "no DFlash drafter, so it drafts as a classic draft model"),
])
def test_bad_draft_checkpoints(tmp_path, capsys, edit, flags, needle):
    hf = make_hf_model("llama", seed=13)
    save_hf_model(hf, tmp_path / "t")
    make_zlab_draft(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 1])
    _edit_config(tmp_path / "d", **edit)
    rc = main(["generate", "--model", str(tmp_path / "t"), "--prompt-ids", "1,2", "--draft", str(tmp_path / "d")] + flags)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err
