"""min_p: keep the tokens at least min_p times as likely as the most likely one (after temperature, top_k and top_p;
0 = off). Its validation; the filtered distribution against a reference computed here; the sampler's draws against
that distribution (chi-square, fixed seeds: deterministic); engine outputs on a tiny random model, plain and
speculative (argmax and probabilistic drafts), distributed as the target's filtered distribution; seeded
reproducibility; the --min-p flag and the server's `min_p` request field, bad values one line / one 400 naming it."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import httpx
import pytest
import torch

from blockspec import rng
from blockspec.cli import main
from blockspec.config import EngineConfig
from blockspec.errors import ConfigError
from blockspec.llm import LLM
from blockspec.sampling import (SamplingParams, SamplingRows, processed_probs, processed_probs_for,
                                processed_probs_rows, race, sample)
from stats_utils import assert_fits, rejected
from test_spec_sampling import _last_logits, models  # noqa: F401 (a fixture)

CPU = torch.device("cpu")

# --------------------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("value", [-0.1, -1, 1.5, 1.0000001, float("nan"), float("inf"), "0.1", True, None])
def test_bad_min_p_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError) as e:
        SamplingParams(min_p=value)
    assert e.value.field == "min_p"
    assert str(e.value) == f"invalid sampling value min_p={value!r}: must be in [0, 1] (0 disables it)"


@pytest.mark.parametrize("value", [0, 0.0, 1e-9, 0.05, 0.5, 1, 1.0])
def test_min_p_in_range_is_accepted(value):
    assert SamplingParams(min_p=value).min_p == value
    assert SamplingParams().min_p == 0.0


# --------------------------------------------------------------------------------------------------------------
# the filtered distribution, exactly


def reference(logits: torch.Tensor, temperature: float, min_p: float, top_k: int = 0, top_p: float = 1.0):
    """float64, one row: softmax(logits / T), top_k, renormalize, top_p (smallest prefix reaching it), renormalize,
    then min_p: the tokens below min_p x the top probability go. Also the distance of the min_p cut from a flip."""
    q = torch.softmax(logits.double() / temperature, -1)
    if 0 < top_k < q.numel():
        q = torch.where(q >= q.topk(top_k).values[-1], q, 0.0)
        q = q / q.sum()
    if top_p < 1.0:
        sp, idx = q.sort(descending=True)
        n = int(((sp.cumsum(0) - sp) < top_p).sum())
        q = torch.zeros_like(q).scatter(0, idx[:n], sp[:n])
        q = q / q.sum()
    ratio = q / q.max()
    margin = float((ratio[q > 0] - min_p).abs().min())
    q = torch.where(ratio >= min_p, q, 0.0)
    return q / q.sum(), margin


# probs [0.5, 0.3, 0.15, 0.05] (ratios to the top 1, 0.6, 0.3, 0.1): min_p keeps the tokens whose ratio reaches it
@pytest.mark.parametrize("min_p, kept", [(0.0, 4), (0.05, 4), (0.2, 3), (0.5, 2), (0.7, 1), (1.0, 1)])
def test_min_p_keeps_the_tokens_within_min_p_of_the_top(min_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    perm = torch.tensor([2, 0, 3, 1])  # scrambled: the cut is by probability, not by index
    got = processed_probs(probs[perm].log()[None], 1.0, 0, 1.0, min_p)[0]
    want = probs.clone()
    want[kept:] = 0.0
    torch.testing.assert_close(got, (want / want.sum())[perm], rtol=1e-5, atol=1e-7)
    assert int((got > 0).sum()) == kept


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("min_p", [0.02, 0.1, 0.3, 0.9])
def test_min_p_after_temperature_matches_the_reference(temperature, min_p):
    logits = torch.randn(6, 24, generator=torch.Generator().manual_seed(int(min_p * 100))) * 2.0
    got = processed_probs(logits, temperature, 0, 1.0, min_p)
    for row, want_logits in zip(got, logits):
        want, margin = reference(want_logits, temperature, min_p)
        assert margin > 1e-5  # no token sits on the cut (fp32 puts the ratios within ~1e-6)
        torch.testing.assert_close(row.double(), want, rtol=1e-5, atol=1e-7)
    # a higher temperature flattens the ratios, so it keeps at least as many tokens
    if temperature < 2.0:
        assert ((processed_probs(logits, 2.0, 0, 1.0, min_p) > 0).sum(-1) >= (got > 0).sum(-1)).all()


def test_min_p_with_top_k_and_top_p_matches_the_reference():
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=9, top_p=0.85, min_p=0.12)
    got = processed_probs_for(logits, params)
    for row, want_logits in zip(got, logits):
        want, margin = reference(want_logits, 0.8, 0.12, 9, 0.85)
        assert margin > 1e-4
        torch.testing.assert_close(row.double(), want, rtol=1e-5, atol=1e-7)


def test_min_p_comes_after_top_p():
    # probs [0.4, 0.3, 0.2, 0.1], top_p 0.75 keeps three (0.4 + 0.3 < 0.75), min_p 0.3 keeps ratios >= 0.3: three.
    # min_p first would rescale the three it keeps to [0.44, 0.33, 0.22], whose first two already reach 0.75.
    got = processed_probs(torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log(), 1.0, 0, 0.75, 0.3)[0]
    torch.testing.assert_close(got, torch.tensor([4.0, 3.0, 2.0, 0.0]) / 9.0)


def test_rows_without_min_p_are_untouched_next_to_rows_with_it():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)) * 2.0
    plain = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
    with_min_p = plain[:1] + [SamplingParams(temperature=1.0, min_p=0.2)] + plain[1:]
    alone = processed_probs_rows(logits[[0, 2]], SamplingRows.build(plain, [0, 0], CPU, 32))
    mixed = SamplingRows.build(with_min_p, [0, 0, 0], CPU, 32)
    assert mixed.use_min_p and not SamplingRows.build(plain, [0, 0], CPU, 32).use_min_p
    together = processed_probs_rows(logits, mixed)
    assert torch.equal(together[[0, 2]], alone)  # bit-identical
    assert (together[1] == 0).any() and torch.equal(together[1], processed_probs(logits[1:2], 1.0, 0, 1.0, 0.2)[0])
    assert mixed.rows(1, 2).min_p.tolist() == pytest.approx([0.2]) and mixed.repeat(2).min_p.shape == (6,)


def test_min_p_one_is_the_top_token():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(2)) * 3.0
    got = processed_probs(logits, 1.5, 0, 1.0, 1.0)
    assert torch.equal(got, torch.nn.functional.one_hot(logits.argmax(-1), 40).float())
    pos = torch.arange(5)
    assert torch.equal(sample(logits, SamplingParams(temperature=2.0, min_p=1.0), 3, pos), logits.argmax(-1))


# --------------------------------------------------------------------------------------------------------------
# the sampler draws from it (chi-square, fixed seeds)


def test_draws_match_the_filtered_distribution_chi_square():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    probs = processed_probs(logits[None], 0.9, 0, 1.0, 0.12)[0]
    support = probs > 0
    assert 3 <= int(support.sum()) < 7  # min_p cuts something, and leaves several tokens
    n = 20_000
    noise = rng.exponential(torch.full((n,), 99), torch.arange(n), rng.STREAM_TARGET, 8)
    counts = Counter(race(probs.expand(n, -1), noise).tolist())
    expect = {v: float(probs[v]) for v in range(8)}
    assert_fits(counts, expect, "min_p draws")
    wider = processed_probs(logits[None], 0.9, 0, 1.0, 0.0)[0]  # power: the unfiltered distribution is rejected
    assert rejected(counts, {v: float(wider[v]) for v in range(8)})


def test_seeded_draws_are_reproducible():
    logits = torch.randn(16, 32, generator=torch.Generator().manual_seed(5)) * 2.0
    pos = torch.arange(16) + 4
    p = SamplingParams(temperature=1.0, min_p=0.05)
    a, b, c = (sample(logits, p, s, pos) for s in (3, 3, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------------------------------------------
# the engine on a tiny random model (8-token vocabulary): plain and speculative outputs distributed as the target

V = 8  # the tiny target of test_spec_sampling (vocabulary 8, peaked) and its random drafter, K = 3
PROMPT = [1, 3, 5]
N_TOKENS, N_SAMPLES = 3, 1500
PARAMS = dict(temperature=0.9, min_p=0.3)


def exact_joint(lm, params: SamplingParams, cuts: list | None = None) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS tokens) by enumeration; `cuts` collects (tokens min_p removed, distance of its cut)."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt = {}
        for prefix, pr in joint.items():
            logits = _last_logits(lm, PROMPT + list(prefix))
            probs = processed_probs_for(logits, params)[0].double()
            if cuts is not None:
                _, margin = reference(logits[0], params.temperature, params.min_p)
                cuts.append((int((probs == 0).sum()), margin))
            nxt.update({prefix + (t,): pr * float(probs[t]) for t in range(V) if probs[t] > 0})
        joint = nxt
    return joint


def engine_counts(lm, draft, params: dict, n: int = N_SAMPLES, seed0: int = 0) -> tuple[Counter, Counter]:
    """The first N_TOKENS tokens of n seeded requests decoded together, and the acceptance lengths of their steps."""
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=128))
    outs = llm.generate([PROMPT] * n, [SamplingParams(seed=seed0 + i, max_tokens=N_TOKENS, ignore_eos=True, **params)
                                       for i in range(n)], use_tqdm=False)
    return Counter(tuple(o.token_ids) for o in outs), Counter(a for o in outs for a in o.acceptance_lengths or [])


def test_enumeration_setup_is_sound(models):
    lm, _ = models
    cuts: list = []
    joint = exact_joint(lm, SamplingParams(**PARAMS), cuts)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-6)
    assert min(m for _, m in cuts) > 1e-4  # no cut hinges on rounding between the enumeration and the engine
    assert any(removed > 0 for removed, _ in cuts) and len(joint) > 8  # min_p bites, and leaves choices
    unfiltered = exact_joint(lm, SamplingParams(temperature=PARAMS["temperature"]))
    assert len(unfiltered) > len(joint)


@pytest.mark.parametrize("drafting", [None, "argmax", "probabilistic"])
def test_engine_outputs_are_distributed_as_the_filtered_target(models, drafting):
    lm, drafts = models
    draft = None if drafting is None else drafts[drafting == "probabilistic"]
    counts, lengths = engine_counts(lm, draft, PARAMS)
    if draft is not None:  # drafts were accepted: the acceptance rule was exercised
        assert sum(n for a, n in lengths.items() if a >= 2) > 0.03 * sum(lengths.values()), lengths
    assert_fits(counts, exact_joint(lm, SamplingParams(**PARAMS)), f"min_p, drafting={drafting}")
    # power: the same draws are rejected against the target without min_p
    assert rejected(counts, exact_joint(lm, SamplingParams(temperature=PARAMS["temperature"])))


def test_engine_min_p_is_seeded_batch_invariant_and_spec_equals_plain(models):
    lm, drafts = models
    p = SamplingParams(temperature=1.0, min_p=0.1, seed=11, max_tokens=24, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, seed=12, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=4, min_p=0.3, seed=13, max_tokens=9, ignore_eos=True)]
    plain = LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=4))
    alone = plain.generate([PROMPT], [p], use_tqdm=False)[0].token_ids
    assert len(alone) == 24 and plain.generate([PROMPT], [p], use_tqdm=False)[0].token_ids == alone
    mixed = plain.generate([[2, 4], PROMPT, [7, 1, 1, 2]], [others[0], p, others[1]], use_tqdm=False)
    assert mixed[1].token_ids == alone
    reseeded = {tuple(plain.generate([PROMPT], [replace(p, seed=s)], use_tqdm=False)[0].token_ids) for s in range(4)}
    assert len(reseeded) > 1
    # with argmax drafts, every emitted token is the target's sample at its position: the tokens of plain decoding
    spec = LLM.from_loaded(lm, drafts[False], engine=EngineConfig(max_num_seqs=4))
    assert spec.generate([PROMPT], [p], use_tqdm=False)[0].token_ids == alone


# --------------------------------------------------------------------------------------------------------------
# the flag and the request field


def test_min_p_flag_reaches_the_engine_and_bad_values_are_one_line(models, capsys):
    lm, _ = models
    base = ["generate", "--model", str(lm.source.path), "--prompt-ids", "1,3,5", "--max-tokens", "8", "--device",
            "cpu", "--json"]
    assert main(base) == 0
    greedy = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(base + ["--temperature", "2", "--min-p", "1", "--seed", "4"]) == 0  # only the top token survives
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy
    for command in (base, ["chat", str(lm.source.path), "--device", "cpu"]):
        assert main(command + ["--min-p", "1.5"]) == 2
        assert capsys.readouterr().err == ("blockspec: error: --min-p: invalid sampling value min_p=1.5: must be in "
                                           "[0, 1] (0 disables it)\n")


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_min_p_is_in_the_help(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--min-p MIN_P" in capsys.readouterr().out


@pytest.fixture(scope="module")
def server():
    from server_utils import LiveServer, tiny_pair

    _, _, lm, _ = tiny_pair()
    srv = LiveServer(LLM.from_loaded(lm, None, engine=EngineConfig(max_model_len=64)).engine)
    yield srv
    srv.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 12}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12}),
])
def test_min_p_request_field(server, path, body):
    def post(**fields):
        return httpx.post(server.url + path, json={**body, **fields}, timeout=60)

    for value, message in [(1.5, "invalid sampling value min_p=1.5: must be in [0, 1] (0 disables it)"),
                           (-0.5, "invalid sampling value min_p=-0.5: must be in [0, 1] (0 disables it)"),
                           ("0.1", "invalid value for 'min_p': Input should be a valid number (got \"0.1\")")]:
        r = post(min_p=value)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
        assert r.json()["error"]["message"] == message
    greedy = post(temperature=0).json()["choices"][0]["token_ids"]
    assert post(temperature=2.0, min_p=1.0, seed=1).json()["choices"][0]["token_ids"] == greedy
    assert post(temperature=2.0, min_p=None, seed=1).status_code == 200  # null: the default, off
