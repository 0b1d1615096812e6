"""DFlash 2 under sampling (probabilistic drafting, temperature > 0) is lossless: the selector draws each draft from
q = softmax(score / T) over its position's top-k candidates, given the draft before it, and the engine's p/q
rejection uses that sparse q (zero outside the candidates). The joint distribution of the first generated tokens,
over many seeded requests through the batched engine, is checked against the target's own distribution enumerated
exactly (chi-square, as tests/test_spec_sampling.py does for DFlash 1), with a negative control that uses the dense
q a DFlash 1 drafter would have. Also: the selector's sampled pass computes the reference's q."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.sampling import SamplingParams, processed_probs
from dense_cache import DenseCausalAttention, DenseKVCache
from dflash_utils import make_zlab_draft2
from hf_utils import make_hf_model, save_hf_model
from stats_utils import assert_fits, rejected

zm = pytest.importorskip("dflash.model")

V = 8
MASK = 6
PROMPT = [1, 3, 5]
K = 3
TOP_K = 3  # candidates per position: most tokens have q = 0 at every draft position
N_SAMPLES = 1500
N_TOKENS = 3
SAMPLED = dict(temperature=0.9, top_k=6, top_p=0.9)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2_sampling")
    hf = make_hf_model("llama", seed=3, vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)  # a peaked (low-entropy) target, so that drafts get accepted
    save_hf_model(hf, root / "target")
    zd = make_zlab_draft2(hf.config, root / "draft", layers=1, block_size=K + 1, target_layer_ids=[0, 1],
                          mask_token_id=MASK, seed=0, selector_top_k=TOP_K, selector_rank=4, codebook_scale=0.7)
    lm = load_model(str(root / "target"), LoadConfig(device="cpu", with_tokenizer=False))
    draft = load_draft(SpeculativeConfig(draft_model=str(root / "draft"), probabilistic_drafting=True), lm)
    assert isinstance(draft.model, DFlash2DraftModel) and draft.spec.num_draft_tokens == K
    return lm, draft, zd


@torch.inference_mode()
def exact_joint(lm, prompt: list[int], n: int, temperature: float, top_k: int, top_p: float) -> dict:
    """P(first n generated tokens), enumerated over every prefix of non-zero probability."""
    cfg = lm.config
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, pr in joint.items():
            seq = prompt + list(prefix)
            cache = DenseKVCache.allocate(cfg.num_hidden_layers, len(seq), cfg.num_key_value_heads, cfg.head_dim,
                                          torch.float32, torch.device("cpu"))
            pos = torch.arange(len(seq))
            logits = lm.model(torch.tensor(seq), pos, DenseCausalAttention(cache, pos, len(seq)),
                              logit_rows=torch.tensor([len(seq) - 1])).logits
            probs = processed_probs(logits, temperature, top_k, top_p)[0].double()
            nxt.update({prefix + (t,): pr * float(probs[t]) for t in range(V) if probs[t] > 0})
        joint = nxt
    return joint


def engine_samples(lm, draft, n: int, params: dict, seed0: int = 0):
    """n seeded requests through one batched engine -> (joint counts, accepted drafts per verify step)."""
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=64, max_num_batched_tokens=64 * (K + 1)))
    outs = llm.generate([PROMPT] * n, [SamplingParams(seed=seed0 + i, max_tokens=N_TOKENS, ignore_eos=True,
                                                      **params) for i in range(n)], use_tqdm=False)
    counts: Counter = Counter()
    accepted: Counter = Counter()
    for o in outs:
        assert len(o.token_ids) == N_TOKENS
        counts[tuple(o.token_ids)] += 1
        accepted.update(s.num_accepted for s in o.steps)
    return counts, accepted


def test_sampled_drafts_are_distributed_as_the_target(models):
    lm, draft, _ = models
    exact = exact_joint(lm, PROMPT, N_TOKENS, **SAMPLED)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-6)
    counts, accepted = engine_samples(lm, draft, N_SAMPLES, SAMPLED)
    steps = sum(accepted.values())
    # acceptance really runs: drafts accepted in many steps, runs of two or more too
    assert steps - accepted[0] > 0.15 * steps, accepted
    assert accepted[2] + accepted[3] > 0.03 * steps, accepted
    assert_fits(counts, exact, "DFlash 2 sampled drafts")


def test_same_seed_same_tokens_and_greedy_rows_keep_the_greedy_pass(models):
    lm, draft, _ = models
    params = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    llm = LLM.from_loaded(lm, draft)
    a, b = llm.generate([PROMPT, PROMPT], [SamplingParams(seed=7, **params)] * 2, use_tqdm=False)
    assert a.token_ids == b.token_ids and a.steps == b.steps
    others = {tuple(o.token_ids) for o in llm.generate([PROMPT] * 5, [SamplingParams(seed=s, **params)
                                                                       for s in range(5)], use_tqdm=False)}
    assert len(others) > 1
    # a greedy request next to sampled ones drafts with the selector's greedy pass: the same as alone
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    mixed = llm.generate([PROMPT] * 3, [SamplingParams(seed=1, **params), greedy, SamplingParams(seed=2, **params)],
                         use_tqdm=False)[1]
    alone = LLM.from_loaded(lm, draft).generate([PROMPT], greedy, use_tqdm=False)[0]
    assert mixed.token_ids == alone.token_ids and mixed.steps == alone.steps


def test_negative_control_dense_q_is_rejected(models, monkeypatch):
    """Power against the bug this file is about: drafts drawn by the selector but accepted with the dense q of the
    whole-vocabulary draft logits (what a DFlash 1 drafter's q would be) are caught by the same test."""
    lm, draft, _ = models
    model = draft.model
    orig = model.sampled_block_drafts

    def dense_q(hidden, anchor, lm_head, temperature, noise):
        drafts, _ = orig(hidden, anchor, lm_head, temperature, noise)
        B, Kb, H = hidden.shape
        logits = model.compute_logits(hidden.reshape(B * Kb, H), lm_head).view(B, Kb, -1)
        t = torch.where(temperature > 0, temperature, 1.0)[:, None, None]
        return drafts, torch.softmax(logits / t, dim=-1)

    monkeypatch.setattr(model, "sampled_block_drafts", dense_q)
    exact = exact_joint(lm, PROMPT, N_TOKENS, **SAMPLED)
    counts, _ = engine_samples(lm, draft, N_SAMPLES, SAMPLED)
    assert rejected(counts, exact)


def test_selector_sampled_pass_computes_the_reference_q(models):
    """Given the same hidden states, logits and anchors, and forced to follow the reference's sampled path, our
    selector's q over the candidates equals the authors' CandidateSelector.select's (which samples with
    torch.multinomial: the path is taken from it, the q compared)."""
    _, draft, zd = models
    gen = torch.Generator().manual_seed(0)
    B, H = 5, zd.config.hidden_size
    hidden = torch.randn(B, K, H, generator=gen)
    logits = torch.randn(B, K, V, generator=gen) * 2
    anchor = torch.randint(V, (B,), generator=gen)
    torch.manual_seed(1)
    path, ref_cand, ref_q = zd.candidate_selector.select(hidden, logits, anchor, 0.8)
    # noise tiny at the reference's pick, huge elsewhere: the race follows the reference's path
    ours_cand = draft.model.candidate_selector.candidates(logits)[1]
    noise = torch.where(ours_cand == path[..., None], 1e-30, 1e30)
    drafts, cand, q = draft.model.candidate_selector.select(hidden, logits, anchor, torch.full((B,), 0.8), noise)
    assert torch.equal(drafts, path)
    dense = torch.zeros(B, K, V).scatter_(2, cand, q)
    ref_dense = torch.zeros(B, K, V).scatter_(2, ref_cand, ref_q)
    torch.testing.assert_close(dense, ref_dense, rtol=1e-6, atol=1e-7)
