"""A classic draft model as the proposer (blockspec/speculative/draft_model.py), fp32 on CPU: greedy engine output
equal to plain decoding in every engine scenario and on both step paths, with two drafters: an unrelated random
model of the target's vocabulary (drafts seldom accepted) and the target itself (every draft accepted). Every step's
drafts equal the draft model's own greedy continuation of the request's history, computed by the dense oracle: the
draft model's K/V in the proposer pages is right, not merely harmless. Seeded sampling equals plain seeded
sampling; the registry and `blockspec generate` pick the method from a plain causal checkpoint."""

from __future__ import annotations

import json

import pytest

from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.sampling import SamplingParams
from blockspec.speculative.draft_model import DraftModelProposer
from blockspec.speculative.registry import load_proposer, method_of
from oracles import generate
from proposer_utils import (
    K, SCENARIOS, check_seeded_sampling, check_single_requests, run_paths, run_scenario, seeded_params, workload,
)
from proposer_utils import ckpts  # noqa: F401 - a fixture, used by name

DRAFTERS = ["other", "self"]


@pytest.fixture(scope="module")
def drafters(ckpts) -> dict[str, LoadedModel]:
    """The draft models, each loaded once: the unrelated one, and a second copy of the target."""
    return {name: load_model(str(path), LoadConfig(device="cpu", with_tokenizer=False))
            for name, path in (("other", ckpts.other), ("self", ckpts.target))}


_greedy_memo: dict = {}


def draft_greedy(draft: LoadedModel, history: list[int], k: int) -> list[int]:
    """The draft model's own greedy continuation of `history` (dense oracle, no stop tokens): the drafts it owes."""
    key = (id(draft), tuple(history), k)
    if key not in _greedy_memo:
        _greedy_memo[key] = generate(draft, history, SamplingParams(max_tokens=k, ignore_eos=True)).token_ids
    return _greedy_memo[key]


def assert_drafts_are_greedy(draft: LoadedModel, prompts, outs) -> None:
    """outs: RequestOutputs, or (token ids, step traces) pairs."""
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens, steps = o if isinstance(o, tuple) else (o.token_ids, o.steps)
        history = p + tokens
        for st in (st for st in steps if st.draft):  # near the context's end a step may verify none
            want = draft_greedy(draft, history[:st.position + 1], len(st.draft))
            assert st.draft == want, f"request {i}, bonus at {st.position}: drafts {st.draft}, its greedy {want}"


def accepted_fraction(outs) -> float:
    steps = [st for o in outs for st in o.steps if st.draft]
    return sum(st.num_accepted for st in steps) / sum(len(st.draft) for st in steps)


def check_acceptance(name: str, outs) -> None:
    """The unrelated drafter is seldom right; the target drafting for itself always is (fp32, the same weights)."""
    if name == "self":
        assert accepted_fraction(outs) == 1.0
    else:
        assert accepted_fraction(outs) < 0.2


@pytest.mark.parametrize("name", DRAFTERS)
def test_single_requests_equal_plain(ckpts, drafters, name):
    prompts, params = workload(5, seed=11)
    outs = check_single_requests(ckpts.lm, lambda: DraftModelProposer(drafters[name], K), prompts, params)
    assert_drafts_are_greedy(drafters[name], prompts, outs)
    check_acceptance(name, outs)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", DRAFTERS)
def test_engine_equals_plain(ckpts, drafters, name, scenario):
    prompts, outs = run_scenario(scenario, ckpts.lm, DraftModelProposer(drafters[name], K))
    assert_drafts_are_greedy(drafters[name], prompts, outs)
    check_acceptance(name, outs)


@pytest.mark.parametrize("name", DRAFTERS)
def test_step_paths_agree(ckpts, drafters, name):
    prompts, params = workload(10, seed=12, max_tokens=(20, 40))
    results = run_paths(ckpts.lm, lambda: DraftModelProposer(drafters[name], K), prompts, params)
    assert len({repr(r) for r in results.values()}) == 1, "the step paths disagree"
    assert_drafts_are_greedy(drafters[name], prompts, [(t, s) for t, _, s in results["default"]])


def test_target_as_its_own_draft_model_accepts_every_draft(ckpts):
    """Through the registry, the method taken from the checkpoint (a plain causal LM: draft-model). With 1 + 6 (K + 1)
    tokens per request every verify step is whole: the mean acceptance length is exactly K + 1."""
    spec = SpeculativeConfig(draft_model=str(ckpts.target), num_draft_tokens=K)
    assert method_of(spec) == "draft-model"
    proposer = load_proposer(spec, ckpts.lm)
    assert isinstance(proposer, DraftModelProposer) and proposer.num_draft_tokens == K
    prompts, _ = workload(8, seed=13)
    params = SamplingParams(max_tokens=1 + 6 * (K + 1), ignore_eos=True)
    outs = LLM.from_loaded(ckpts.lm, proposer,
                           engine=EngineConfig(max_num_seqs=4, block_size=4)).generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == generate(ckpts.lm, p, params).token_ids
        assert o.acceptance_lengths == [K + 1] * 6 and o.mean_acceptance_length == K + 1


@pytest.mark.parametrize("name", DRAFTERS)
def test_seeded_sampling_equals_plain(ckpts, drafters, name):
    prompts, _ = workload(9, seed=14)
    params = seeded_params(9, seed=14)
    if name == "other":  # nothing gets accepted: only the equality is checked
        llm = LLM.from_loaded(ckpts.lm, DraftModelProposer(drafters[name], K),
                              engine=EngineConfig(max_num_seqs=4, block_size=4))
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == [generate(ckpts.lm, p, sp).token_ids for p, sp in zip(prompts, params)]
    else:
        outs = check_seeded_sampling(ckpts.lm, DraftModelProposer(drafters[name], K), prompts, params)
    assert_drafts_are_greedy(drafters[name], prompts, outs)


def test_generate_command(ckpts, capsys):
    """`blockspec generate --draft <plain causal LM>`: the draft-model method, from the checkpoint."""
    prompt = workload(1, seed=15)[0][0]
    capsys.readouterr()
    rc = main(["generate", "--model", str(ckpts.target), "--device", "cpu", "--prompt-ids", ",".join(map(str, prompt)),
               "--max-tokens", str(1 + 3 * (K + 1)), "--draft", str(ckpts.target), "--num-draft-tokens", str(K),
               "--draft-len-schedule", "off", "--json", "--trace"])  # K throughout, not this machine's calibration
    result = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert result["token_ids"] == generate(ckpts.lm, prompt, SamplingParams(max_tokens=1 + 3 * (K + 1))).token_ids
    assert result["acceptance_lengths"] == [K + 1] * 3 and len(result["steps"]) == 3
