"""The CPU bf16 drafter (SpeculativeConfig.cpu_bf16_draft; the packed linears themselves: test_cpu_packed_target): the
packed drafter computes what the unpacked one does, within bf16 rounding, and keeps no unused weights; with an
fp32 target, engine and single-request speculative decoding stay token-identical to plain fp32 greedy decoding and
a trained drafter is still accepted; bad set-ups fail with an error that names the flag."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from blockspec.attention.torch_ref import attend
from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import ConfigError, ModelLoadError
from oracles import generate
from blockspec.layers import cpu_packed
from blockspec.layers.cpu_packed import PackedLinear
from blockspec.llm import LLM
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.loading.prepare import pack_draft
from blockspec.models.dflash import DFlashDraftModel
from blockspec.models.dflash_io import DraftHead, OwnHead
from blockspec.models.qkv import PackedQKV
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from dflash_utils import cli_pair, make_zlab_draft, needs_bf16
from hf_utils import make_hf_model, save_hf_model
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair, with_k



def packed(draft: LoadedDraft, lm) -> LoadedDraft:
    """A packed copy of `draft` (the shared models are left as they are)."""
    model = copy.deepcopy(draft.model)
    pack_draft(model, lm.model.lm_head, torch.bfloat16, draft.spec.draft_rows(draft.spec.num_draft_tokens))
    return dataclasses.replace(draft, model=model)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Within `tol` of the reference's scale (bf16 keeps 8 mantissa bits)."""
    return a.shape == b.shape and float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max())


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_drafter_matches_the_unpacked_one(bias, dtype):
    """Context k/v, the block forward and the logits of the packed model equal the fp32 model's within bf16
    rounding (fp32: within fp32 rounding); the q/k/v projections are gone (no unused packed copies), every other
    linear is packed once; an fp32 drafter drafts through the (fp32) target head itself, not a copy."""
    tol = 1.0 if dtype == torch.bfloat16 else 1e-4  # x the bf16 tolerances below
    pair = trained_pair()
    cfg = dataclasses.replace(pair.draft.config, attention_bias=bias, num_hidden_layers=2,
                              layer_causal=[False, False], layer_window=[None, None])
    torch.manual_seed(0)
    ref = DFlashDraftModel(cfg, num_taps=2).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms off 1, biases off 0
    model = copy.deepcopy(ref)
    head = pair.lm.model.lm_head
    # the loader packs an fp32 drafter only over a packed fp32 target, whose head it then drafts through
    model_head = head if dtype == torch.bfloat16 else PackedLinear.from_linear(head, dtype, 16, keep_weight=True)
    pack_draft(model, model_head, dtype, 8, vocab=40)
    assert model.dtype == dtype and not any(type(m) is nn.Linear for m in model.modules())
    for layer in model.layers:  # the packed q|k|v keeps no parameters
        assert type(layer.self_attn.qkv_proj) is PackedQKV and not list(layer.self_attn.qkv_proj.parameters())
    # per layer q|k|v, o_proj, gate_up, down; fc; all layers' context k|v; the whole head (bf16); the 40-row head
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 4 * 2 + (4 if dtype == torch.bfloat16 else 3)
    assert (type(model.head) is DraftHead) == (dtype == torch.float32)
    g = torch.Generator().manual_seed(1)
    H = cfg.hidden_size
    taps, pos = torch.randn(9, 2 * H, generator=g), torch.arange(9)
    with torch.inference_mode():
        for (k, v), (rk, rv) in zip(model.context_kv(taps, pos), ref.context_kv(taps, pos)):
            assert k.dtype == dtype and close(k, rk, 3e-2 * tol) and close(v, rv, 3e-2 * tol)

        def attn(layer, q, k, v, scale, causal, window):  # the block sees itself only: enough to compare
            return attend(q, k, v, torch.ones(q.shape[0], k.shape[0], dtype=torch.bool), scale)

        embeds, bpos = torch.randn(8, H, generator=g), torch.arange(9, 17)
        hidden, ref_hidden = model(embeds, bpos, attn), ref(embeds, bpos, attn)
        assert hidden.dtype == dtype and close(hidden, ref_hidden, 5e-2 * tol)
        logits = model.compute_logits(hidden, model_head)  # the whole head, not the 40-row one
        assert logits.dtype == torch.float32 and logits.shape == (8, head.out_features)
        assert close(logits, ref.compute_logits(ref_hidden, head), 5e-2 * tol)
        drafts = model.greedy_drafts(hidden, model_head)
        assert drafts.max() < 40 and torch.equal(drafts, logits[:, :40].argmax(-1))


@needs_bf16
@pytest.mark.parametrize("k", [3, 7])
def test_trained_drafter_in_bf16_is_lossless_and_accepted(k):
    """fp32 target, bf16 drafter: single-request and engine outputs (decode step and varlen step) are exactly the
    plain fp32 greedy ones, and the trained drafter's drafts are still accepted in long runs."""
    pair = trained_pair()
    lm, draft = pair.lm, packed(with_k(pair.draft, k), pair.lm)
    prompts = [[14, 15, 16, 17], CYCLE_B[7:12], cycle_seq(CYCLE_A, 3, 30), [3, 50, 21, 7, 44, 12, 60]]
    refs = [generate(lm, p, greedy(40)).token_ids for p in prompts]
    for p, ref in zip(prompts[:2], refs):
        out = spec_generate(lm, draft, p, greedy(40))
        assert out.token_ids == ref
        tau = sum(out.acceptance_lengths) / len(out.acceptance_lengths)
        assert tau > (3.0 if k == 3 else 5.0), (k, tau, out.acceptance_lengths)  # as the fp32 drafter (3.9, 7.8)
    llm = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4))
    pool = llm.engine.pool
    assert pool.k.dtype == torch.float32 and pool.draft_k.dtype == pool.draft_v.dtype == torch.bfloat16
    assert [o.token_ids for o in llm.generate(prompts, greedy(40), use_tqdm=False)] == refs
    varlen = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4, step_path="varlen"))
    outs = varlen.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert max(a for o in outs for a in o.acceptance_lengths) == k + 1


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A random tiny fp32 llama and the directory of a random 2-layer DFlash drafter for it (block 8)."""
    root = tmp_path_factory.mktemp("bf16_tiny")
    hf = make_hf_model("llama", seed=3, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    save_hf_model(hf, root / "target")
    make_zlab_draft(hf.config, root / "draft", layers=2, block_size=8, target_layer_ids=[0, 1], mask_token_id=127,
                    seed=1)
    return load_model(str(root / "target"), LoadConfig(device="cpu", with_tokenizer=False)), root / "draft"


@needs_bf16
def test_load_draft_packs_and_a_random_drafter_stays_lossless(tiny_pair):
    """load_draft(cpu_bf16_draft=True) with an fp32 target: the engine and the single-request loop emit the plain
    greedy tokens; the target is left in fp32."""
    lm, draft_dir = tiny_pair
    draft = load_draft(SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=3, cpu_bf16_draft=True), lm)
    assert draft.model.dtype == torch.bfloat16 and isinstance(draft.model.head, OwnHead)
    assert draft.model.greedy_head is draft.model.head
    assert all(p.dtype == torch.float32 for p in lm.model.parameters())
    prompts = [[5, 9, 2, 77, 31], list(range(40, 90))]
    refs = [generate(lm, p, greedy(24)).token_ids for p in prompts]
    assert [spec_generate(lm, draft, p, greedy(24)).token_ids for p in prompts] == refs
    outs = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=2)).generate(prompts, greedy(24), use_tqdm=False)
    assert [o.token_ids for o in outs] == refs


@needs_bf16
def test_cli_generate_with_cpu_bf16_draft(tmp_path, capsys):
    base = cli_pair(tmp_path)
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    for extra in (["--cpu-bf16-draft"], ["--cpu-bf16-draft", "--draft-vocab-size", "64"]):
        assert main(base + ["--draft", str(tmp_path / "d"), "--num-draft-tokens", "3", "--trace", *extra,
                            "--draft-len-schedule", "off"]) == 0  # drafts every step (a calibration may pick K = 0)
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == plain["token_ids"]
        if "--draft-vocab-size" in extra:
            assert all(t < 64 for s in out["steps"] for t in s["draft"])
    assert main(base + ["--cpu-bf16-draft"]) == 2
    assert capsys.readouterr().err == "blockspec: error: --cpu-bf16-draft needs --draft\n"
    assert main(base + ["--trace", "--num-draft-tokens", "3", "--probabilistic-drafting"]) == 2
    assert capsys.readouterr().err == ("blockspec: error: --num-draft-tokens, --probabilistic-drafting and --trace need "
                                       "--draft\n")


def test_cpu_bf16_draft_errors_name_the_flag(tiny_pair, monkeypatch):
    lm, draft_dir = tiny_pair
    spec = SpeculativeConfig(draft_model=str(draft_dir), cpu_bf16_draft=True)
    on_meta = dataclasses.replace(lm, model=nn.Linear(1, 1, device="meta"))  # stands in for a GPU target
    with pytest.raises(ModelLoadError, match=r"^cpu_bf16_draft=True needs the target on the CPU, but it is on meta$"):
        load_draft(spec, on_meta)
    monkeypatch.setattr(cpu_packed, "bf16_supported", lambda device: False)
    with pytest.raises(ModelLoadError, match=r"^cpu_bf16_draft=True needs a CPU with oneDNN bf16 kernels "
                                             r"\(AVX512-BF16 or AMX\); this one has none"):
        load_draft(spec, lm)
    # tensor parallelism shards the drafter's nn.Linear layers, which packing replaces: refused before a rank starts
    with pytest.raises(ConfigError, match=r"^cpu_bf16_draft=True is not supported with tensor_parallel_size > 1"):
        LLM(str(draft_dir.parent / "target"), speculative=spec, load=LoadConfig(device="cpu"),
            engine=EngineConfig(tensor_parallel_size=2))
