"""A smaller draft head (SpeculativeConfig.draft_vocab_size = N): argmax drafts over the token ids < N only, in fp32
(a view of the target's lm_head rows) and in the packed bf16 drafter, through the multiplier / softcap branch too;
outputs stay exactly plain greedy decoding; config errors name the field. Also: greedy picks are max().indices,
which returns the first maximum on ties, as argmax does."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import ConfigError
from oracles import generate
from blockspec.llm import LLM
from blockspec.loading.dflash_options import resolve_spec
from blockspec.loading.draft_loader import LoadedDraft
from blockspec.loading.prepare import limit_draft_vocab, pack_draft
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from dflash_utils import make_zlab_draft, needs_bf16
from hf_utils import make_hf_model, save_hf_model
from trained_pair import CYCLE_A, CYCLE_B, VOCAB, cycle_seq, trained_pair, with_k

HEADS = ["fp32", pytest.param("bf16", marks=needs_bf16)]


def limited(draft: LoadedDraft, lm, n: int, head: str) -> LoadedDraft:
    """A copy of `draft` whose argmax drafts are over token ids < n (fp32 view of the head, or packed bf16)."""
    model = copy.deepcopy(draft.model)
    if head == "bf16":
        pack_draft(model, lm.model.lm_head, torch.bfloat16, 8, vocab=n)
    else:
        limit_draft_vocab(model, lm.model.lm_head, n)
    return dataclasses.replace(draft, model=model)


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_bad_draft_vocab_size_is_refused(value):
    with pytest.raises(ConfigError, match=rf"^draft_vocab_size={value!r} must be an integer >= 1 \(or None"):
        SpeculativeConfig(draft_model="d", draft_vocab_size=value)


def test_draft_vocab_size_limits():
    with pytest.raises(ConfigError, match=r"^draft_vocab_size=8 works with argmax drafting only, not with "
                                          r"probabilistic_drafting$"):
        SpeculativeConfig(draft_model="d", draft_vocab_size=8, probabilistic_drafting=True)
    pair = trained_pair()
    for n in (1, VOCAB):
        resolve_spec(SpeculativeConfig(draft_model="d", draft_vocab_size=n), pair.draft.config, pair.lm.config, "d")
    with pytest.raises(ConfigError, match=rf"^draft_vocab_size={VOCAB + 1} is out of range: the target's vocabulary "
                                          rf"allows 1..{VOCAB}$"):
        resolve_spec(SpeculativeConfig(draft_model="d", draft_vocab_size=VOCAB + 1), pair.draft.config,
                     pair.lm.config, "d")


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("scaled", [False, True])
def test_greedy_drafts_stay_below_n(head, scaled):
    """Drafts are the argmax over the first N logits (with the drafter's multiplier and softcap when it has them);
    compute_logits, for sampled drafts, still covers the whole vocabulary."""
    pair = trained_pair()
    lm_head = pair.lm.model.lm_head
    model = limited(pair.draft, pair.lm, 20, head).model
    if scaled:  # a negative multiplier reverses the ranking: a head that ignored the branch would pick other ids
        model.config = dataclasses.replace(model.config, output_multiplier=-0.5, final_logit_softcapping=3.0)
    hidden = torch.randn(32, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    with torch.inference_mode():
        drafts = model.greedy_drafts(hidden, lm_head)
        full = model.compute_logits(hidden, lm_head)
        small = model.greedy_head(hidden, lm_head).float()
    assert full.shape == (32, VOCAB) and small.shape == (32, 20)
    if scaled:
        small = torch.tanh(small * -0.5 / 3.0) * 3.0
    assert drafts.max() < 20 and torch.equal(drafts, small.argmax(-1))
    assert not torch.equal(drafts, full.argmax(-1))  # the restriction did change some drafts here
    if head == "fp32":  # a view of the target's head rows, not a copy
        assert model.greedy_head.proj.weight.data_ptr() == lm_head.weight.data_ptr()


@pytest.mark.parametrize("scaled", [False, True])
def test_greedy_drafts_take_the_first_maximum_on_ties(scaled):
    model = copy.deepcopy(trained_pair().draft.model)
    if scaled:
        model.config = dataclasses.replace(model.config, output_multiplier=2.0)
    H = model.config.hidden_size
    head = nn.Linear(H, 6, bias=False)
    with torch.no_grad():  # logits [0, 1, 3, 3, 2, 3] for a hidden state of ones: exact ties at ids 2, 3 and 5
        head.weight.copy_(torch.tensor([0.0, 1.0, 3.0, 3.0, 2.0, 3.0])[:, None].expand(6, H) / H)
    hidden = torch.ones(2, H)
    assert model.greedy_drafts(hidden, head).tolist() == [2, 2] == head(hidden).argmax(-1).tolist()
    limit_draft_vocab(model, head, 3)
    assert model.greedy_drafts(hidden, head).tolist() == [2, 2]


@pytest.mark.parametrize("head", HEADS)
def test_engine_and_single_request_lossless_with_draft_vocab(head):
    """N = 30 splits the trained pair's two token cycles: CYCLE_A (ids 10..29) is still drafted and accepted in long
    runs, CYCLE_B (ids 30..49) can never be drafted, so nothing is accepted there; every output is still the plain
    greedy one, and every draft, in the engine's trace and the reference loop's, is < 30."""
    pair = trained_pair()
    lm, draft = pair.lm, limited(with_k(pair.draft, 7), pair.lm, 30, head)
    prompts = [cycle_seq(CYCLE_A, 4, 6), CYCLE_B[7:12], [3, 50, 21, 7, 44, 12, 60]]
    refs = [generate(lm, p, SamplingParams(max_tokens=40, ignore_eos=True)).token_ids for p in prompts]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    singles = [spec_generate(lm, draft, p, params) for p in prompts]
    outs = LLM.from_loaded(lm, draft,
                           engine=EngineConfig(max_num_seqs=3, block_size=4)).generate(prompts, params, use_tqdm=False)
    for ref, single, out in zip(refs, singles, outs):
        assert single.token_ids == out.token_ids == ref
        assert all(t < 30 for step in single.steps + out.steps for t in step.draft)
    taus = [sum(o.acceptance_lengths) / len(o.acceptance_lengths) for o in outs]
    assert taus[0] > 5.0 and taus[1] == 1.0, taus


def test_cli_generate_with_draft_vocab_size(tmp_path, capsys):
    """fp32 through load_draft and the CLI: same tokens as plain decoding, drafts < N."""
    hf = make_hf_model("llama", seed=5)
    save_hf_model(hf, tmp_path / "t")
    make_zlab_draft(hf.config, tmp_path / "d", block_size=8, target_layer_ids=[0, 2], scale=2.0)
    base = ["generate", "--model", str(tmp_path / "t"), "--prompt-ids", "7,8,9,10", "--max-tokens", "24", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(tmp_path / "d"), "--draft-vocab-size", "16", "--trace",
                        "--draft-len-schedule", "off"]) == 0  # drafts in every step, whatever this machine measures
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain["token_ids"]
    assert all(t < 16 for s in out["steps"] for t in s["draft"]) and out["steps"]
