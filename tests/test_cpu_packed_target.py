"""The CPU-packed target (LoadConfig(cpu_packed=True), --cpu-packed): fp32 linears packed for oneDNN compute what
F.linear does within fp32 rounding at any row count; a packed target decodes the same greedy tokens as the unpacked
one, plainly and with every drafter set-up (fp32, bf16, smaller draft vocabulary; engine and single-request loop);
the lm_head stays readable for the drafter; bad set-ups fail with an error that names the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import BlockspecError, ConfigError
from oracles import generate
from blockspec.layers import cpu_packed
from blockspec.layers.cpu_packed import PackedLinear, pack_linears, pack_target
from blockspec.llm import LLM
from blockspec.speculative import registry
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.models.qkv import PackedContextKV
from blockspec.sampling import SamplingParams
from oracles import spec_generate
from blockspec.train.export import save_draft
from dflash_utils import cli_pair, needs_bf16
from hf_utils import make_hf_model, save_hf_model
from trained_pair import CYCLE_A, CYCLE_B, cycle_seq, trained_pair

pytestmark = pytest.mark.skipif(not cpu_packed.fp32_supported(torch.device("cpu")), reason="torch without oneDNN")
bf16_cpu = cpu_packed.bf16_supported(torch.device("cpu"))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(bias, dtype):
    """F.linear in `dtype` at any row count and leading dims (fp32 input cast inside); pack_linears replaces every
    nn.Linear below a module, nested ones included, and nothing else."""
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    p = PackedLinear.from_linear(lin, dtype, 16)
    assert not hasattr(p, "weight")  # the original is not kept unless asked
    w, b = lin.weight.detach().to(dtype), lin.bias.detach().to(dtype) if bias else None
    for shape in [(1, 48), (3, 48), (16, 48), (37, 48), (2, 5, 48), (0, 48)]:
        x = torch.randn(*shape, generator=g)
        y = p(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], 80)
        torch.testing.assert_close(y.float(), F.linear(x.to(dtype), w, b).float(), rtol=tol, atol=tol)
    m = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    x = torch.randn(5, 8, generator=g)
    with torch.no_grad():
        ref = m[1](m[0](x.to(dtype).float()).to(dtype).float())
        pack_linears(m, dtype, 16)
        assert [type(c).__name__ for c in (m[0], *m[1])] == ["PackedLinear", "ReLU", "PackedLinear"]
        torch.testing.assert_close(m(x).float(), ref, rtol=2 * tol, atol=2 * tol)


def test_pack_target_replaces_every_linear_and_keeps_the_head_weight(tmp_path):
    save_hf_model(make_hf_model("llama", seed=3, tie_word_embeddings=True), tmp_path / "t")
    model = load_model(str(tmp_path / "t"), LoadConfig(device="cpu", with_tokenizer=False)).model
    embed = model.embed_tokens.weight
    assert model.lm_head.weight is embed
    pack_target(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight is embed  # tied: the drafter's reads of lm_head.weight see the embedding
    # per layer qkv, o, gate_up, down; the head
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 4 * len(model.layers) + 1


@pytest.fixture(scope="module")
def packed_pair(tmp_path_factory):
    """The trained pair's target loaded again with cpu_packed=True, and its trained drafter saved to a directory."""
    pair = trained_pair()
    target = Path(pair.lm.source.path)
    config = json.loads((target.parent / "draft" / "config.json").read_text())
    draft_dir = save_draft(pair.draft.model, config, tmp_path_factory.mktemp("packed") / "draft", dtype=torch.float32)
    lm = load_model(str(target), LoadConfig(device="cpu", with_tokenizer=False, cpu_packed=True))
    assert isinstance(lm.model.lm_head, PackedLinear)
    return pair, lm, draft_dir


@pytest.mark.parametrize("drafter", ["fp32", "fp32-vocab", "bf16", "bf16-vocab"])
def test_packed_target_is_lossless_with_every_drafter(packed_pair, drafter):
    """Plain greedy of the packed target = of the unpacked one; speculative decoding over the packed target and its
    packed drafter (engine decode step, varlen step, single-request loop) emits the same tokens, and the trained
    drafter is accepted."""
    if drafter.startswith("bf16") and not bf16_cpu:
        pytest.skip("this CPU has no oneDNN bf16 kernels")
    pair, lm, draft_dir = packed_pair
    prompts = [[14, 15, 16, 17], CYCLE_B[7:12], cycle_seq(CYCLE_A, 3, 30), [3, 50, 21, 7, 44, 12, 60]]
    refs = [generate(pair.lm, p, greedy(40)).token_ids for p in prompts]  # the unpacked target
    assert [generate(lm, p, greedy(40)).token_ids for p in prompts] == refs
    spec = SpeculativeConfig(draft_model=str(draft_dir), num_draft_tokens=5, cpu_bf16_draft=drafter.startswith("bf16"),
                             draft_vocab_size=50 if drafter.endswith("vocab") else None)
    draft = load_draft(spec, lm)
    # the drafter of a packed target is packed too, in its own dtype (fp32 here unless --cpu-bf16-draft)
    assert isinstance(draft.model.context_proj, PackedContextKV)
    assert not any(type(m) is nn.Linear for m in draft.model.modules())
    assert draft.model.dtype == (torch.bfloat16 if spec.cpu_bf16_draft else torch.float32)
    out = spec_generate(lm, draft, prompts[0], greedy(40))
    assert out.token_ids == refs[0]
    assert sum(out.acceptance_lengths) / len(out.acceptance_lengths) > 3.0, out.acceptance_lengths
    assert [o.token_ids for o in LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4))
            .generate(prompts, greedy(40), use_tqdm=False)] == refs
    varlen = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=4, block_size=4, step_path="varlen"))
    assert [o.token_ids for o in varlen.generate(prompts, greedy(40), use_tqdm=False)] == refs


def test_cli_generate_and_bench_flags(tmp_path, capsys, monkeypatch):
    packed: list[nn.Module] = []
    monkeypatch.setattr(cpu_packed, "pack_target", lambda model, f=pack_target: packed.append(model) or f(model))
    base = cli_pair(tmp_path)
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    for extra in (["--cpu-packed"], ["--cpu-packed", "--draft", str(tmp_path / "d"), "--num-draft-tokens", "3"]):
        assert main(base + extra) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"], extra
        assert isinstance(packed.pop().lm_head, PackedLinear) and not packed
    bench = ["bench", "--model", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--num-draft-tokens", "3",
             "--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "8", "--device", "cpu", "--json"]
    drafts = []  # what bench's load_draft returned: the flags must reach the drafter
    monkeypatch.setattr(registry, "load_draft", lambda *a, f=load_draft: drafts.append(f(*a)) or drafts[-1])
    extra = ["--cpu-bf16-draft"] if bf16_cpu else []
    assert main(bench + ["--cpu-packed", "--full-block-drafting", "--draft-vocab-size", "64", *extra]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["outputs_identical"] is True and report["config"]["cpu_packed"] is True
    assert isinstance(packed.pop().lm_head, PackedLinear) and not packed
    (draft,) = drafts
    assert draft.spec.draft_rows(3) == 8 and draft.model.greedy_head.proj.out_features == 64
    assert draft.model.dtype == (torch.bfloat16 if bf16_cpu else torch.float32)
    assert main(base + ["--cpu-packed", "--tensor-parallel-size", "2"]) == 2
    assert "cpu_packed=True is not supported with tensor_parallel_size > 1" in capsys.readouterr().err
    assert main(bench[:3] + ["--cpu-bf16-draft"]) == 2  # a drafter flag without a drafter
    assert capsys.readouterr().err == "blockspec: error: --cpu-bf16-draft needs --draft\n"
    assert main(bench[:3] + ["--draft-vocab-size", "8", "--full-block-drafting"]) == 2
    assert capsys.readouterr().err == "blockspec: error: --full-block-drafting and --draft-vocab-size need --draft\n"


def test_cpu_packed_errors_name_the_flag(tmp_path, monkeypatch):
    save_hf_model(make_hf_model("llama", seed=1), tmp_path / "t")
    with pytest.raises(BlockspecError, match=r"^cpu_packed=True \(--cpu-packed\) packs fp32 weights \(bf16 on CPUs "
                                             r"with bf16 kernels\), not torch.float16$"):
        load_model(str(tmp_path / "t"), LoadConfig(device="cpu", dtype="float16", cpu_packed=True))
    with pytest.raises(ConfigError, match=r"^cpu_packed=True is not supported with tensor_parallel_size > 1"):
        LLM(str(tmp_path / "t"), load=LoadConfig(device="cpu", cpu_packed=True),
            engine=EngineConfig(tensor_parallel_size=2))
    monkeypatch.setattr(cpu_packed, "fp32_supported", lambda device: False)
    with pytest.raises(BlockspecError, match=r"^cpu_packed=True \(--cpu-packed\) needs a CPU with oneDNN, but this "
                                             r"torch build cannot pack linears for oneDNN \(mkldnn\)$"):
        load_model(str(tmp_path / "t"), LoadConfig(device="cpu", cpu_packed=True))


def test_support_probe_says_no_where_the_ops_fail(monkeypatch):
    """A torch build whose oneDNN lacks the packing ops reports no support (the demo then runs F.linear) instead of
    failing at load."""
    class NoPacking:
        def _reorder_linear_weight(self, *args):
            raise RuntimeError("mkldnn linear packing is not available on this build")

    cpu = torch.device("cpu")
    cpu_packed._packs.cache_clear()
    try:
        monkeypatch.setattr(torch.ops, "mkldnn", NoPacking())
        assert not cpu_packed.fp32_supported(cpu) and not cpu_packed.bf16_supported(cpu)
        monkeypatch.undo()
        cpu_packed._packs.cache_clear()
        assert cpu_packed.fp32_supported(cpu)  # this build packs (the module's skip mark says so)
    finally:
        cpu_packed._packs.cache_clear()
