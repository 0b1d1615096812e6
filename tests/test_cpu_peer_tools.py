"""The functions of the CPU comparison tools (tools/cpu_quant_agreement.py, tools/cpu_peer_bench.py) that do not need
llama-cpp-python: the teacher-forced argmax that top-1 agreement counts, and where two outputs first differ."""

from __future__ import annotations

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
