"""Speculative sampling is lossless: with DFlash speculation (argmax/one-hot drafting and probabilistic drafting) the
joint distribution of the first generated tokens equals the target's own sampling distribution (temperature, top_k,
top_p), checked by a chi-square goodness-of-fit test against the exact distribution enumerated from the target.

Also: unit tests of the batched accept functions (`accept_probabilistic` by Monte-Carlo, `accept_tokens` by hand),
seeded reproducibility of spec sampling, and top_k=1 sampling == greedy.

Everything uses fixed seeds, so the statistics are deterministic: a test cannot flake, it either passes or fails."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dense_cache import DenseCausalAttention, DenseKVCache
from blockspec.config import SpeculativeConfig
from oracles import generate
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams, processed_probs
from oracles import spec_generate
from blockspec.speculative.verify import accept_probabilistic, accept_tokens
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model
from stats_utils import ALPHA, assert_fits, chi2_critical, chi2_sf, chi_square_gof, rejected


@pytest.mark.parametrize("df, table", [(1, 10.828), (2, 13.816), (5, 20.515), (10, 29.588), (30, 59.703),
                                       (50, 86.661), (100, 149.449)])
def test_chi2_critical_values_match_the_table(df, table):
    assert chi2_critical(df) == pytest.approx(table, abs=2e-3)
    assert chi2_sf(table, df) == pytest.approx(ALPHA, rel=1e-3)


def test_chi_square_pools_small_cells():
    probs = {0: 0.5, 1: 0.49, 2: 0.004, 3: 0.003, 4: 0.003}
    stat, df = chi_square_gof({0: 50, 1: 49, 2: 1}, probs)  # expected 50, 49, and 1.0 pooled into the 49
    assert df == 1 and stat == pytest.approx(0.0)
    with pytest.raises(AssertionError, match="never produce"):
        chi_square_gof({0: 50, 5: 1}, probs)


# --------------------------------------------------------------------------------------------------------------
# accept_tokens / accept_probabilistic, directly


def test_accept_tokens_is_greedy_verification_by_hand():
    drafts = torch.tensor([
        [3, 4, 5],  # all accepted -> bonus from the last row
        [3, 9, 5],  # second draft wrong -> correction 4, third draft ignored even though it matches
        [7, 4, 5],  # first draft wrong
        [3, 4, 0],  # last draft wrong
    ])
    target_logits = torch.full((4, 4, 10), -1.0)
    choice = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [1, 4, 5, 6], [3, 4, 5, 8]])
    target_logits.scatter_(2, choice[..., None], 2.0)
    tokens, n = accept_tokens(drafts, target_logits.argmax(-1))
    assert n.tolist() == [3, 1, 0, 2]
    assert tokens.tolist() == [[3, 4, 5, 6], [3, 4, -1, -1], [1, -1, -1, -1], [3, 4, 5, -1]]
    # greedy verification written out: accept while d_i == argmax of the row before it, then emit that argmax
    for b in range(4):
        ref, row = [], 0
        while row < 3 and drafts[b, row] == choice[b, row]:
            ref.append(int(drafts[b, row]))
            row += 1
        ref.append(int(choice[b, row]))
        assert tokens[b, : len(ref)].tolist() == ref and int(n[b]) == len(ref) - 1


def _random_dist(gen: torch.Generator, rows: int, V: int, zero: list[int | None]) -> torch.Tensor:
    logits = torch.randn(rows, V, generator=gen) * 1.5
    for r, z in enumerate(zero):
        if z is not None:
            logits[r, z] = float("-inf")  # as top_k / top_p truncation leaves it
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_accept_probabilistic_first_token_is_distributed_as_p(K):
    V, B = 5, 200_000
    gen = torch.Generator().manual_seed(100 + K)
    # zeros in p where q has mass and vice versa: the residual max(p - q, 0) must handle both
    p = _random_dist(gen, K + 1, V, [4, None, 0, None][: K + 1])
    q = _random_dist(gen, K, V, [0, 4, None][:K])
    drafts = torch.multinomial(q, B, replacement=True, generator=gen).T  # [B, K], each row's d_i ~ q_i
    uniform = torch.rand(B, K, generator=gen)
    noise = torch.empty(B, V).exponential_(generator=gen)
    tokens, n = accept_probabilistic(drafts, p.expand(B, K + 1, V), q.expand(B, K, V), uniform, noise)
    assert tokens.shape == (B, K + 1) and n.shape == (B,)
    assert ((n >= 0) & (n <= K)).all()
    # emitted tokens are d_1..d_n then one more, -1 after
    idx = torch.arange(K + 1)[None]
    assert (tokens[idx < n[:, None]] == torch.cat([drafts, drafts[:, :1]], 1)[idx < n[:, None]]).all()
    assert (tokens.gather(1, n[:, None]) >= 0).all() and (tokens[idx > n[:, None]] == -1).all()

    first = Counter(tokens[:, 0].tolist())
    assert_fits(first, {v: float(p[0, v]) for v in range(V)}, f"first token, K={K}")
    # acceptance probability of the first draft is sum_v min(p, q) (the coupling's overlap)
    rate, expect = float((n >= 1).double().mean()), float(torch.minimum(p[0], q[0]).sum())
    assert abs(rate - expect) < 5 * math.sqrt(expect * (1 - expect) / B)
    if K >= 2:
        # given the first draft was accepted, the next emitted token is distributed as p[1] (p is context-free here)
        second = Counter(tokens[n >= 1, 1].tolist())
        assert_fits(second, {v: float(p[1, v]) for v in range(V)}, f"second token, K={K}")


def test_accept_probabilistic_equal_p_q_accepts_everything_and_one_hot_q_is_accept_tokens():
    V, K, B = 5, 3, 4000
    gen = torch.Generator().manual_seed(7)
    p = _random_dist(gen, K + 1, V, [None] * (K + 1))
    drafts = torch.multinomial(p[:K], B, replacement=True, generator=gen).T
    uniform = torch.rand(B, K, generator=gen)
    noise = torch.empty(B, V).exponential_(generator=gen)
    tokens, n = accept_probabilistic(drafts, p.expand(B, K + 1, V), p[:K].expand(B, K, V), uniform, noise)
    assert (n == K).all()
    assert (tokens[:, :K] == drafts).all()
    assert (tokens[:, K] == (p[K].expand(B, V) / noise).argmax(-1)).all()  # bonus sampled from p at row K
    # a one-hot q (argmax drafting) makes the p/q rule the same as accepting while the target's sample matches,
    # in distribution: both first tokens are distributed as p[0]
    d = p[:K].argmax(-1).expand(B, K)
    q1 = torch.nn.functional.one_hot(d, V).float()
    tokens, _ = accept_probabilistic(d, p.expand(B, K + 1, V), q1, uniform, noise)
    assert_fits(Counter(tokens[:, 0].tolist()), {v: float(p[0, v]) for v in range(V)}, "one-hot q")


# --------------------------------------------------------------------------------------------------------------
# end to end: a tiny target with an 8-token vocabulary and a random drafter that agrees with it now and then

V = 8
MASK = 6  # mask_token_id must be inside the (tiny) vocabulary
PROMPT = [1, 3, 5]
K = 3
N_SAMPLES = 1500
N_TOKENS = 3
# all three processing steps active: the top_k/top_p truncations both bite in the enumerated contexts (checked below)
SAMPLED = dict(temperature=0.9, top_k=6, top_p=0.9)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny matmuls: extra threads only add synchronisation cost (and a lot of it on a busy machine).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_sampling")
    hf = make_hf_model("llama", seed=3, vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)  # a peaked (low-entropy) target, so that drafts get accepted
    save_hf_model(hf, root / "target")
    # seeds chosen so that the drafter proposes varied blocks and its argmax often matches the target's sample
    make_zlab_draft(hf.config, root / "draft", layers=1, block_size=4, target_layer_ids=[0, 1], mask_token_id=MASK,
                    seed=0)
    lm = load_model(str(root / "target"), LoadConfig(device="cpu", with_tokenizer=False))
    drafts = {prob: load_draft(SpeculativeConfig(draft_model=str(root / "draft"), num_draft_tokens=K,
                                                 probabilistic_drafting=prob), lm) for prob in (False, True)}
    return lm, drafts


@torch.inference_mode()
def _last_logits(lm, seq: list[int]) -> torch.Tensor:
    cfg = lm.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, len(seq), cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    pos = torch.arange(len(seq))
    out = lm.model(torch.tensor(seq), pos, DenseCausalAttention(cache, pos, len(seq)),
                   logit_rows=torch.tensor([len(seq) - 1]))
    return out.logits


def exact_joint(lm, prompt: list[int], n: int, temperature: float, top_k: int, top_p: float,
                margins: list | None = None) -> dict[tuple[int, ...], float]:
    """P(first n generated tokens) by enumeration of every prefix with non-zero probability."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, pr in joint.items():
            logits = _last_logits(lm, prompt + list(prefix))
            probs = processed_probs(logits, temperature, top_k, top_p)[0].double()
            if margins is not None:
                margins.append(_truncation_margin(logits[0], temperature, top_k, top_p))
            for t in range(V):
                if probs[t] > 0:
                    nxt[prefix + (t,)] = pr * float(probs[t])
        joint = nxt
    return joint


def _truncation_margin(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[float, int]:
    """(distance of the top_k / top_p cuts from a flip, number of tokens kept): the enumerated support must not hinge
    on a rounding difference between the enumeration's forward and the engine's verify forward."""
    x = torch.sort(logits.float() / temperature, descending=True).values
    gap = float("inf")
    if 0 < top_k < x.numel():
        gap = float(x[top_k - 1] - x[top_k])
        x = x[:top_k]
    probs = torch.softmax(x, -1)
    excl = probs.cumsum(-1) - probs  # mass before each token: dropped when >= top_p
    kept = int((excl < top_p).sum())
    return min(gap, float((excl - top_p).abs().min())), kept


def spec_samples(lm, draft, n: int, params: dict, seed0: int = 0):
    counts: Counter = Counter()
    lengths: Counter = Counter()
    accepted: Counter = Counter()
    for i in range(n):
        r = spec_generate(lm, draft, PROMPT, SamplingParams(seed=seed0 + i, max_tokens=N_TOKENS, ignore_eos=True,
                                                            **params))
        assert len(r.token_ids) == N_TOKENS and r.finish_reason == "length"
        counts[tuple(r.token_ids)] += 1
        lengths.update(r.acceptance_lengths)
        accepted.update(s.num_accepted for s in r.steps)
    return counts, lengths, accepted


def test_enumeration_setup_is_sound(models):
    """The exact joint used below is a proper distribution, truncation really happens, and no cut is a near-tie."""
    lm, _ = models
    margins: list = []
    joint = exact_joint(lm, PROMPT, N_TOKENS, margins=margins, **SAMPLED)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-6)
    assert min(m for m, _ in margins) > 1e-4
    kept = [k for _, k in margins]
    assert min(kept) < SAMPLED["top_k"]  # top_p cut below top_k somewhere
    assert max(kept) == SAMPLED["top_k"]  # and top_k is the binding cut somewhere else
    assert len(joint) < V**N_TOKENS


@pytest.mark.parametrize("probabilistic", [False, True], ids=["argmax_drafts", "probabilistic_drafts"])
def test_spec_sampling_matches_target_distribution(models, probabilistic):
    lm, drafts = models
    draft = drafts[probabilistic]
    exact = exact_joint(lm, PROMPT, N_TOKENS, **SAMPLED)
    counts, lengths, accepted = spec_samples(lm, draft, N_SAMPLES, SAMPLED)
    steps = sum(accepted.values())
    # the run must exercise acceptance: acceptance lengths > 1, drafts accepted in many steps (num_accepted is
    # counted before the max_tokens cut), and runs of two or more accepted drafts
    assert lengths[2] > 0.03 * steps, lengths
    assert steps - accepted[0] > 0.15 * steps, accepted
    assert accepted[2] + accepted[3] > 0.03 * steps, accepted
    assert_fits(counts, exact, f"spec sampling, probabilistic={probabilistic}")


def test_negative_control_wrong_temperature_is_rejected(models):
    """Power: at the same sample size the same test rejects a sampler that is off (temperature 1.3 instead of 0.9,
    same top_k; no top_p, whose cut would move with the temperature and make the support alone give it away), and
    accepts a correct one (the exact distribution sampled directly). Ten independent draws each, so this measures
    the power instead of relying on one lucky draw. (For scale: 1.3 vs 1.0 without truncation, a smaller change on
    this peaked target, is rejected in only about 2 of 3 draws at this sample size.)"""
    lm, _ = models
    right = exact_joint(lm, PROMPT, N_TOKENS, 0.9, SAMPLED["top_k"], 1.0)
    wrong = exact_joint(lm, PROMPT, N_TOKENS, 1.3, SAMPLED["top_k"], 1.0)
    assert set(wrong) == set(right)  # only the chi-square statistic can tell them apart
    gen = torch.Generator().manual_seed(11)

    def draw(joint):
        cells = list(joint)
        idx = torch.multinomial(torch.tensor([joint[c] for c in cells]), N_SAMPLES, replacement=True, generator=gen)
        return Counter(cells[i] for i in idx.tolist())

    assert sum(rejected(draw(right), right) for _ in range(10)) == 0
    assert sum(rejected(draw(wrong), right) for _ in range(10)) == 10


def test_negative_control_lossy_acceptance_is_rejected(models, monkeypatch):
    """Power against the kind of bug this file is about: an off-by-one verifier that compares draft d_i with the
    target's sample at ITS OWN row (instead of the row before it) is caught by the same test."""
    import oracles as single

    def off_by_one(drafts, target_tokens):
        shifted = torch.cat([target_tokens[:, 1:], target_tokens[:, -1:]], dim=1)
        return accept_tokens(drafts, shifted)

    monkeypatch.setattr(single, "accept_tokens", off_by_one)
    lm, drafts = models
    exact = exact_joint(lm, PROMPT, N_TOKENS, **SAMPLED)
    counts, _, _ = spec_samples(lm, drafts[False], 300, SAMPLED)
    assert rejected(counts, exact)


# --------------------------------------------------------------------------------------------------------------
# reproducibility and degenerate sampling


@pytest.mark.parametrize("probabilistic", [False, True], ids=["argmax_drafts", "probabilistic_drafts"])
def test_same_seed_same_tokens(models, probabilistic):
    lm, drafts = models
    draft = drafts[probabilistic]
    params = dict(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    a = spec_generate(lm, draft, PROMPT, SamplingParams(seed=1234, **params))
    b = spec_generate(lm, draft, PROMPT, SamplingParams(seed=1234, **params))
    assert a.token_ids == b.token_ids and a.steps == b.steps and len(a.token_ids) == 24
    others = {tuple(spec_generate(lm, draft, PROMPT, SamplingParams(seed=s, **params)).token_ids) for s in range(5)}
    assert len(others) > 1  # the seed matters


@pytest.mark.parametrize("probabilistic", [False, True], ids=["argmax_drafts", "probabilistic_drafts"])
def test_top_k_1_sampling_with_spec_equals_greedy(models, probabilistic):
    lm, drafts = models
    draft = drafts[probabilistic]
    greedy = generate(lm, PROMPT, SamplingParams(max_tokens=30, ignore_eos=True)).token_ids
    assert spec_generate(lm, draft, PROMPT, SamplingParams(max_tokens=30, ignore_eos=True)).token_ids == greedy
    for seed in (0, 1, 2):
        out = spec_generate(lm, draft, PROMPT, SamplingParams(temperature=1.0, top_k=1, seed=seed, max_tokens=30,
                                                              ignore_eos=True))
        assert out.token_ids == greedy
