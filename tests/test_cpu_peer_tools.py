"""The functions of the CPU comparison tools (tools/cpu_quant_agreement.py, tools/cpu_peer_bench.py and its busy-machine
guard and llama.cpp CLI driver) that need neither llama-cpp-python nor a llama.cpp build: the teacher-forced argmax that
top-1 agreement counts, where two outputs first differ, which repeats count, the CLI's command line and output."""

from __future__ import annotations

import pytest

from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from hf_utils import make_hf_model, save_hf_model
from tool_utils import ROOT, load_tool


def test_teacher_forced_argmax_reproduces_greedy_decoding(tmp_path):
    """Fed its own greedy answer, a model's argmax after each position is the token it generated there: one forward
    over the whole sequence predicts what decoding step by step chose."""
    agreement = load_tool("cpu_quant_agreement")
    lm = load_model(str(save_hf_model(make_hf_model("qwen3", seed=4), tmp_path / "t")),
                    LoadConfig(device="cpu", with_tokenizer=False))
    prompt = [5, 9, 31, 2, 77]
    answer = LLM.from_loaded(lm, None).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True),
                                                 use_tqdm=False)[0].token_ids
    assert agreement.argmaxes(lm, prompt + answer)[len(prompt) - 1:-1] == answer


def test_first_difference(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))  # the script imports its sibling, as when run from tools/
    bench = load_tool("cpu_peer_bench")
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2


def _repeat(rate, before=0.0, after=0.0):
    return {"rate": rate, "busy_before": before, "busy_after": after}


def test_busy_guard_discards_busy_and_collapsed_repeats():
    """A repeat counts only when the machine was quiet just before and just after its run and its rate did not collapse
    below half the median of the row's other quiet repeats; the median is over the counted ones only (an outside
    re-run under load once printed 'blockspec 9.40x llama.cpp' from a median of two collapsed llama.cpp repeats)."""
    guard = load_tool("cpu_peer_guard")
    quiet = [_repeat(100), _repeat(104), _repeat(98)]
    assert guard.judge(quiet, max_busy=0.5) == [None, None, None]
    assert guard.summarize(quiet, 0.5)["tokens_per_second"] == 100
    # busy before one run, busy after another: both out whatever their rates
    rows = [_repeat(100), _repeat(120, before=1.0), _repeat(101, after=0.6), _repeat(99, before=0.4, after=0.3)]
    why = guard.judge(rows, max_busy=0.5)
    assert why[0] is None and why[3] is None
    assert why[1].startswith("busy") and why[2].startswith("busy")
    summary = guard.summarize(rows, 0.5)
    assert summary["tokens_per_second"] == 99.5 and summary["repeats_counted"] == 2
    assert [d["repeat"] for d in summary["discarded"]] == [2, 3]
    # quiet at both samples but busy on average during the run (a burst between the samples)
    why = guard.judge([{**_repeat(100), "busy_during": 0.8}, {**_repeat(97), "busy_during": 0.1}], max_busy=0.5)
    assert why[0].startswith("busy") and "0.8 during" in why[0] and why[1] is None
    # two collapsed repeats of five: the median would have picked one; they are discarded instead
    collapsed = [_repeat(110), _repeat(12), _repeat(105), _repeat(11), _repeat(108)]
    why = guard.judge(collapsed, max_busy=0.5)
    assert [w is None for w in why] == [True, False, True, False, True]
    assert why[1].startswith("collapsed")
    assert guard.summarize(collapsed, 0.5)["tokens_per_second"] == 108
    # a slower repeat that is not below half the others' median counts; one repeat alone has nothing to compare with
    assert guard.judge([_repeat(100), _repeat(60), _repeat(90)], 0.5) == [None, None, None]
    assert guard.judge([_repeat(5)], 0.5) == [None]
    # every repeat busy: no median at all rather than a busy one
    none = guard.summarize([_repeat(100, before=2), _repeat(90, after=1)], 0.5)
    assert none["tokens_per_second"] is None and none["repeats_counted"] == 0 and len(none["discarded"]) == 2


def test_llama_cpp_peer_command_and_output(tmp_path):
    """The llama.cpp CLI driver: token ids in (no template or tokenization on llama.cpp's side), greedy, the mode's
    flags, one 'PEER {json}' line per prompt out; tau counts tokens per target step."""
    peer = load_tool("llama_cpp_peer")
    assert peer.prompt_text([[1, 2, 3], [4, 5]]) == "ids:1,2,3;4,5"
    f = tmp_path / "p.txt"
    plain = peer.command("plain", tmp_path / "t.gguf", 2, 16, f)
    assert plain[plain.index("--spec-type") + 1] == "none" and plain[plain.index("-n") + 1] == "16"
    assert plain[plain.index("--temp") + 1] == "0" and plain[plain.index("-t") + 1] == "2"
    dflash = peer.command("dflash", tmp_path / "t.gguf", 1, 16, f, draft_n=6)
    assert dflash[dflash.index("--spec-type") + 1] == "draft-dflash"
    assert dflash[dflash.index("--spec-draft-n-max") + 1] == "6" and dflash[dflash.index("-td") + 1] == "1"
    assert peer.command("ngram", tmp_path / "t.gguf", 1, 16, f)[-5] == "ngram-simple"
    with pytest.raises(ValueError):
        peer.command("dflash", tmp_path / "t.gguf", 1, 16, f)
    out = ("log line\nPEER {\"tokens\": [5, 6, 7], \"seconds\": 0.5, \"prompt_seconds\": 0.1, \"n_drafted\": 4, "
           "\"n_accept\": 1}\nPEER {\"tokens\": [8], \"seconds\": 0.5, \"prompt_seconds\": 0.1, \"n_drafted\": 0, "
           "\"n_accept\": 0}\n")
    outs = peer.parse_output(out)
    assert [o["tokens"] for o in outs] == [[5, 6, 7], [8]]
    assert peer.rate(outs) == 4.0 and peer.tau(outs) == 4 / 3
