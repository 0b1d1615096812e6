"""`blockspec serve` with the other speculative methods: n-gram lookup and a classic draft model behind the same
server, driven by the official `openai` client over loopback; text, token ids and acceptance equal the offline
engine's with the same proposer, and the tokens equal plain decoding (greedy, fp32, CPU). The serve command takes
--speculative-method and refuses a combination that does not fit with one line."""

from __future__ import annotations

import pytest

from blockspec.cli import main
from blockspec.llm import LLM
from blockspec.sampling import SamplingParams
from blockspec.speculative.draft_model import DraftModelProposer
from blockspec.speculative.ngram import NgramProposer
from server_utils import LiveServer, tiny_pair

PROMPTS = ["abcabcabcab", "The quick brown fox", "1212121"]  # repeats for the n-gram lookup to find


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _proposer(method: str, lm):
    # the draft model is the target itself: a draft model of the same tokenizer that is always right
    return NgramProposer(4, 3) if method == "ngram" else DraftModelProposer(lm, 3)


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_served_completions_equal_the_offline_engine_and_plain(pair, method):
    _, _, lm, _ = pair
    params = SamplingParams(max_tokens=24)
    refs = LLM.from_loaded(lm, _proposer(method, lm)).generate(PROMPTS, params, use_tqdm=False)
    plain = LLM.from_loaded(lm, None).generate(PROMPTS, params, use_tqdm=False)
    assert [r.token_ids for r in refs] == [p.token_ids for p in plain]
    assert max(max(r.acceptance_lengths) for r in refs) > 1  # drafts were accepted, not only corrections
    server = LiveServer(LLM.from_loaded(lm, _proposer(method, lm)).engine)
    try:
        got = server.client().completions.create(model="tiny", prompt=PROMPTS, max_tokens=24, temperature=0)
    finally:
        server.stop()
    assert [c.token_ids for c in got.choices] == [r.token_ids for r in refs]
    assert [c.text for c in got.choices] == [lm.tokenizer.decode(r.token_ids) for r in refs]
    assert got.usage.acceptance["acceptance_lengths"] == [r.acceptance_lengths for r in refs]


def test_serve_refuses_a_method_that_does_not_fit(pair, capsys):
    target, draft, _, _ = pair
    assert main(["serve", str(target), "--speculative-method", "ngram", "--draft", str(draft)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: --draft: draft_model=") and "method='ngram'" in err
    assert err.count("\n") == 1
