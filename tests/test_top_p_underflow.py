"""A top_p that underflows to 0 in fp32 (1e-300) keeps the top token (the sampler never drops every token), so it
equals greedy decoding through the engine (plain and speculative), the dense oracle and `blockspec generate`."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.cli import main
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams, SamplingRows, processed_probs, processed_probs_rows
from hf_utils import make_hf_model, save_hf_model
from oracles import generate
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

PROMPT = [1, 17, 42, 99, 5, 64, 3]


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-45])  # 0 in fp32, 0 in fp32, the smallest fp32 subnormal
def test_top_p_underflowing_fp32_keeps_the_top_token(top_p):
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    want = torch.nn.functional.one_hot(logits.argmax(-1), 16).float()
    assert torch.equal(processed_probs(logits, 1.0, 0, top_p), want)
    # batched, next to rows that do not filter: only the tiny-top_p rows become one-hot
    params = [SamplingParams(temperature=1.0, top_p=q) for q in (top_p, 1.0, top_p, 0.5)]
    got = processed_probs_rows(logits, SamplingRows.build(params, [0] * 4, torch.device("cpu"), 16))
    assert not got.isnan().any()
    assert torch.equal(got[[0, 2]], want[[0, 2]])
    torch.testing.assert_close(got[1], torch.softmax(logits[1], -1))


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama", seed=0), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def tiny_lm(tiny_lm_dir):
    return load_model(str(tiny_lm_dir), LoadConfig(device="cpu", with_tokenizer=False))


@pytest.mark.parametrize("seed", [0, None])
def test_top_p_tiny_equals_greedy_through_the_engine(tiny_lm, seed):
    def run(**kw):
        params = SamplingParams(max_tokens=20, ignore_eos=True, **kw)
        return LLM.from_loaded(tiny_lm, None).generate([PROMPT], params, use_tqdm=False)[0].token_ids

    greedy = run()
    assert len(set(greedy)) > 1  # a real continuation, not one token repeated
    assert run(temperature=1.0, top_p=1e-300, seed=seed) == greedy  # top_p -> 0 keeps only the top token
    assert generate(tiny_lm, PROMPT, SamplingParams(temperature=1.0, top_p=1e-300, seed=seed, max_tokens=20,
                                                    ignore_eos=True)).token_ids == greedy


def test_top_p_tiny_equals_greedy_speculative():
    pair = trained_pair()  # drafts accepted: steps of several tokens, verified under the tiny top_p
    prompts = [cycle_seq(CYCLE_A, 3, 12), cycle_seq(CYCLE_B, 0, 9)]

    def run(**kw):
        params = SamplingParams(max_tokens=24, **kw)
        return LLM.from_loaded(pair.lm, pair.draft).generate(prompts, params, use_tqdm=False)

    greedy = run()
    assert all(len(set(o.token_ids)) > 1 and o.mean_acceptance_length > 2 for o in greedy)
    tiny = run(temperature=1.0, top_p=1e-300, seed=11)
    assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]
    assert all(o.mean_acceptance_length > 2 for o in tiny)


def test_cli_top_p_tiny_equals_greedy(tiny_lm_dir, capsys):
    def run(*flags: str) -> list[int]:
        assert main(["generate", "--model", str(tiny_lm_dir), "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--max-tokens", "16", "--json", "--device", "cpu", *flags]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    greedy = run()
    assert len(set(greedy)) > 1
    assert run("--temperature", "1", "--top-p", "1e-300", "--seed", "5") == greedy
