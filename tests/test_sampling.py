"""Sampler tests: SamplingParams validation, the processed distribution (temperature/top_k/top_p), the exactness
of the exponential-race sampler (chi-square, fixed seeds), and seeded end-to-end generation on a tiny HF llama. (A top_p that underflows in fp32, end to end:
tests/test_top_p_underflow.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.errors import BlockspecError, ConfigError
from blockspec import rng
from blockspec.sampling import SamplingParams, SamplingRows, processed_probs, race, sample, sample_rows

# --------------------------------------------------------------------------------------------------------------
# SamplingParams validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", -1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_k", -100),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.5),
        ("top_p", 1.0000001),
        ("top_p", float("nan")),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("seed", -1),
        ("seed", -12345),
        ("seed", 1.5),
    ],
)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ConfigError) as ei:
        SamplingParams(**{field: value})
    msg = str(ei.value)
    assert field in msg
    assert repr(value) in msg
    assert isinstance(ei.value, BlockspecError)  # the CLI turns it into a one-line error


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 1e-3},
        {"temperature": 2},  # int is accepted
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_p": 1},
        {"max_tokens": 1},
        {"seed": 0},
        {"seed": 2**40},
        {"seed": None},
    ],
)
def test_valid_sampling_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


def test_greedy_flag_and_seed():
    assert SamplingParams().greedy
    p = SamplingParams(temperature=1.0, seed=7)
    assert not p.greedy
    assert p.resolve_seed() == 7
    assert SamplingParams().resolve_seed() != SamplingParams().resolve_seed()  # unseeded: fresh 62-bit seeds


# --------------------------------------------------------------------------------------------------------------
# processed_probs


def _logits(n: int = 3, v: int = 10, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2.0


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.5, 4.0])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    logits = _logits()
    got = processed_probs(logits, temperature, 0, 1.0)
    want = torch.softmax(logits.double() / temperature, dim=-1).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(logits.shape[0]))


def test_processed_probs_upcasts_half_logits():
    logits = _logits().to(torch.bfloat16)
    got = processed_probs(logits, 1.0, 0, 1.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.softmax(logits.float(), -1))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 9])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = _logits(n=4, v=10, seed=1)
    temperature = 0.9
    got = processed_probs(logits, temperature, k, 1.0)
    for row_logits, row in zip(logits, got):
        top = set(torch.topk(row_logits, k).indices.tolist())
        kept = set(torch.nonzero(row > 0).flatten().tolist())
        assert kept == top
        # the kept tokens keep their relative probabilities: softmax over the kept logits only
        idx = sorted(top)
        want = torch.softmax(row_logits[idx] / temperature, -1)
        torch.testing.assert_close(row[idx], want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(logits.shape[0]))


@pytest.mark.parametrize("k", [0, -1, 10, 50])
def test_top_k_off_or_at_least_vocab_is_identity(k):
    logits = _logits(n=2, v=10, seed=2)
    torch.testing.assert_close(processed_probs(logits, 1.0, k, 1.0), torch.softmax(logits, -1))


# probs [0.5, 0.3, 0.15, 0.05]: the smallest prefix (in descending order) whose mass reaches top_p is kept
@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.2, 1),
        (0.5, 1),  # 0.5 alone reaches 0.5
        (0.51, 2),
        (0.79, 2),
        (0.8, 2),  # 0.5 + 0.3 reaches 0.8 exactly
        (0.81, 3),
        (0.95, 3),
        (0.96, 4),
        (1.0, 4),
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    perm = torch.tensor([2, 0, 3, 1])  # scramble the order: the prefix is by probability, not by index
    logits = probs[perm].log().unsqueeze(0)
    got = processed_probs(logits, 1.0, 0, top_p)[0]
    want_sorted = probs.clone()
    want_sorted[kept:] = 0.0
    want_sorted = want_sorted / want_sorted.sum()
    torch.testing.assert_close(got, want_sorted[perm], rtol=1e-5, atol=1e-7)
    assert int((got > 0).sum()) == kept
    assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-6)


def test_top_p_tiny_keeps_only_the_top_token():
    logits = _logits(n=5, v=16, seed=3)
    got = processed_probs(logits, 1.0, 0, 1e-6)
    assert torch.equal(got.argmax(-1), logits.argmax(-1))
    assert torch.equal((got > 0).sum(-1), torch.ones(5, dtype=torch.long))
    torch.testing.assert_close(got.max(-1).values, torch.ones(5))


def test_top_p_rowwise_and_after_temperature_and_top_k():
    logits = _logits(n=6, v=12, seed=4)
    T, k, p = 0.8, 6, 0.7
    got = processed_probs(logits, T, k, p)
    torch.testing.assert_close(got.sum(-1), torch.ones(6))
    for row_logits, row in zip(logits, got):
        # reference: temperature, keep top k, renormalize, then nucleus on that distribution
        q = torch.softmax(row_logits.double() / T, -1)
        order = q.argsort(descending=True)
        q_k = torch.zeros_like(q)
        q_k[order[:k]] = q[order[:k]]
        q_k /= q_k.sum()
        sp, idx = q_k.sort(descending=True)
        n_keep = int(((sp.cumsum(0) - sp) < p).sum())
        want = torch.zeros_like(q)
        want[idx[:n_keep]] = sp[:n_keep] / sp[:n_keep].sum()
        torch.testing.assert_close(row.double(), want, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------------------------
# sample_from is distribution-exact (chi-square goodness of fit, fixed seeds: deterministic, cannot flake)

# Upper 1e-4 quantile of the chi-square distribution with 5 degrees of freedom (6 categories).
CHI2_CRIT_DF5_ALPHA_1E4 = 25.74


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum().double()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def _draw(probs: torch.Tensor, n: int, seed: int, vary: str = "position") -> torch.Tensor:
    """n draws from probs: one request sampling n positions, or (vary="seed") n requests at one position."""
    idx = torch.arange(n)
    seeds, pos = (torch.full((n,), seed), idx) if vary == "position" else (idx * 7919 + seed, torch.full((n,), 5))
    noise = rng.exponential(seeds, pos, rng.STREAM_TARGET, probs.numel())
    ids = race(probs.unsqueeze(0).expand(n, -1), noise)
    assert ids.shape == (n,)
    return torch.bincount(ids, minlength=probs.numel())


@pytest.mark.parametrize("seed,vary", [(0, "position"), (1, "position"), (12345, "position"), (3, "seed")])
def test_sample_from_matches_distribution_chi_square(seed, vary):
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    counts = _draw(probs, 20_000, seed, vary)
    assert int(counts.sum()) == 20_000
    stat = _chi_square(counts, probs)
    assert stat < CHI2_CRIT_DF5_ALPHA_1E4, (stat, counts.tolist())


def test_chi_square_has_power_against_a_wrong_distribution():
    # The same draws judged against a slightly different distribution must fail: the test above is not vacuous.
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    wrong = torch.tensor([0.32, 0.28, 0.2, 0.1, 0.07, 0.03])
    counts = _draw(probs, 20_000, 0)
    assert _chi_square(counts, wrong) > CHI2_CRIT_DF5_ALPHA_1E4


def test_sample_from_processed_distribution_chi_square():
    # The full path: temperature + top_k + top_p, then the race. Zero-probability tokens are never drawn.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    probs = processed_probs(logits.unsqueeze(0), 0.9, 7, 0.97)[0]
    support = probs > 0
    assert 3 <= int(support.sum()) < 7  # both filters actually cut something
    counts = _draw(probs, 20_000, 99)
    assert int(counts[~support].sum()) == 0
    stat = _chi_square(counts[support], probs[support])
    df = int(support.sum()) - 1
    # generous bound: the 1e-4 critical value grows with df; 25.74 at df 5, below 30 for df <= 6
    assert stat < {2: 18.43, 3: 21.11, 4: 23.52, 5: 25.74, 6: 27.86}[df], (stat, counts.tolist())


def test_sample_rows_seeded_and_batch_invariant():
    logits = _logits(n=64, v=32, seed=5)
    pos = torch.arange(64) + 10
    p = SamplingParams(temperature=1.0)
    a, b, c = (sample(logits, p, s, pos) for s in (3, 3, 4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.shape == (64,) and a.dtype == torch.long
    # a row's sample depends only on (its logits, seed, position): not on the other rows of the batch
    mixed = [SamplingParams(temperature=t, top_k=k, top_p=q) for t, k, q in [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 5, 0.9)]]
    rows = SamplingRows.build(mixed * 2, [3, 3, 3, 9, 9, 9], torch.device("cpu"), 32)
    together = sample_rows(logits[:6], rows, pos[:6])
    for i in range(6):
        alone = sample(logits[i:i + 1], mixed[i % 3], [3, 9][i // 3], pos[i:i + 1])
        assert int(together[i]) == int(alone[0]), i


def test_sample_one_hot_and_greedy():
    logits = _logits(n=8, v=20, seed=6)
    pos = torch.arange(8)
    assert torch.equal(sample(logits, SamplingParams(), 0, pos), logits.argmax(-1))
    assert torch.equal(sample(logits, SamplingParams(temperature=1.0, top_k=1), 0, pos), logits.argmax(-1))
    assert torch.equal(sample(logits, SamplingParams(temperature=3.0, top_p=1e-6), 0, pos), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_maximum_on_ties(dtype):
    """Greedy rows use max().indices (faster than argmax on CPU): on ties it must return the first maximum, as
    argmax does, alone and next to sampled rows."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [1.0, 2.0, 7.0, 7.0]], dtype=dtype)
    pos = torch.arange(3)
    assert sample(logits, SamplingParams(), 0, pos).tolist() == [1, 0, 2] == logits.argmax(-1).tolist()
    rows = SamplingRows.build([SamplingParams(), SamplingParams(temperature=1.0), SamplingParams()], [0, 1, 2],
                              logits.device, 4)
    picked = sample_rows(logits, rows, pos)
    assert picked[0] == 1 and picked[2] == 2


# --------------------------------------------------------------------------------------------------------------
# end to end: seeded generation on a tiny random HF llama


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from blockspec.loading.loader import LoadConfig, load_model
    try:
        from tests.hf_utils import make_hf_model, save_hf_model
    except ImportError:
        from hf_utils import make_hf_model, save_hf_model

    d = save_hf_model(make_hf_model("llama", seed=0), tmp_path_factory.mktemp("tiny_llama"))
    return load_model(str(d), LoadConfig(device="cpu", with_tokenizer=False))


PROMPT = [1, 17, 42, 99, 5, 64, 3]


def test_seeded_generation_is_reproducible(tiny_lm):
    from oracles import generate

    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=20, ignore_eos=True)
    a = generate(tiny_lm, PROMPT, params)
    b = generate(tiny_lm, PROMPT, params)
    assert len(a.token_ids) == 20 and a.finish_reason == "length"
    assert a.num_prompt_tokens == len(PROMPT)
    assert a.token_ids == b.token_ids
    assert all(0 <= t < tiny_lm.config.vocab_size for t in a.token_ids)


def test_different_seed_gives_different_ids(tiny_lm):
    from oracles import generate

    runs = [
        generate(tiny_lm, PROMPT, SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True))
        for s in (123, 124, 7)
    ]
    assert runs[0].token_ids != runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids
    # sampling actually samples: not just the greedy continuation
    greedy = generate(tiny_lm, PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert any(r.token_ids != greedy.token_ids for r in runs)


@pytest.mark.parametrize("seed", [0, 123, None])
def test_top_k_1_equals_greedy(tiny_lm, seed):
    from oracles import generate

    greedy = generate(tiny_lm, PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    topk1 = generate(tiny_lm, PROMPT, SamplingParams(temperature=1.0, top_k=1, seed=seed, max_tokens=20, ignore_eos=True))
    assert len(greedy.token_ids) == 20
    assert topk1.token_ids == greedy.token_ids


def test_unseeded_sampling_still_valid(tiny_lm):
    from oracles import generate

    r = generate(tiny_lm, PROMPT, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True))
    assert len(r.token_ids) == 5
    assert all(0 <= t < tiny_lm.config.vocab_size for t in r.token_ids)


def test_sample_rows_in_chunks_equals_all_at_once():
    logits = _logits(n=10, v=40, seed=8)
    mixed = [SamplingParams(temperature=t, top_k=k, top_p=q) for t, k, q in
             [(1.0, 0, 1.0), (0.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.8), (0.9, 3, 1.0)]] * 2
    rows = SamplingRows.build(mixed, list(range(10)), torch.device("cpu"), 40)
    pos = torch.arange(10) + 3
    whole = sample_rows(logits, rows, pos, chunk=10)
    for chunk in (1, 3, 4):
        assert torch.equal(sample_rows(logits, rows, pos, chunk=chunk), whole)
