"""Batch invariance (LoadConfig(batch_invariant=True)): a row's GEMM output and a query's attention output are
bitwise the same whatever they are batched with, so greedy speculative output equals plain decoding in bf16 too.
On CPU the kernels run under Triton's interpreter in fp32 (its bf16 dot is broken); the GPU runs bf16 as well."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")
from blockspec.attention.backends import get_backend  # noqa: E402
from blockspec.attention.triton_paged import paged_attention  # noqa: E402
from blockspec.config import EngineConfig
from blockspec.errors import BlockspecError, ConfigError  # noqa: E402
from blockspec.layers import kernels  # noqa: E402
from blockspec.layers.invariant_linear import (InvariantLinear, Tile, invariant_linear,  # noqa: E402
                                               make_batch_invariant)
from blockspec.llm import LLM  # noqa: E402
from blockspec.loading.loader import LoadConfig, load_model  # noqa: E402
from blockspec.sampling import SamplingParams  # noqa: E402
from test_triton_attention import make_case  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("tile", ["64,64,64,4,3", "16,32,128,4,4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_rows_do_not_depend_on_the_number_of_rows(dtype, tile):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 200, generator=g).to(DEV, dtype)  # K not a multiple of the tile: masked last K step
    w = torch.randn(90, 200, generator=g).to(DEV, dtype)
    b = torch.randn(90, generator=g).to(DEV, dtype)
    t = Tile.parse(tile)
    full = invariant_linear(x, w, b, tile=t)
    for m in (1, 3, 16, 64, 65, 149):
        assert torch.equal(invariant_linear(x[:m], w, b, tile=t), full[:m]), m
    assert torch.equal(invariant_linear(x[70:71], w, b, tile=t)[0], full[70])  # a row alone, mid-tile
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 0.5  # bf16 output rounding at |y| ~ 15
    assert (full.float() - ref).abs().max().item() < tol
    assert invariant_linear(x[:0], w).shape == (0, 90)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_verify_rows_equal_decode_rows(dtype):
    """Each query of a verify block (batched with other requests, long contexts where the keys are split: more splits
    than the query alone gets, and past the last split's start) equals the same query decoded alone with only its own
    prefix cached."""
    page, hq, hkv, d = 16, 6, 2, 32
    q_lens, ctx_lens = [8, 1, 5], [4200, 333, 70]
    q, kc, vc, tables, qs, positions = make_case(5, page, hq, hkv, d, q_lens, ctx_lens)
    q, kc, vc = q.to(DEV, dtype), kc.to(DEV, dtype), vc.to(DEV, dtype)
    kv_lens = torch.tensor([c + n for c, n in zip(ctx_lens, q_lens)])

    def attend(rows, lens, tbl, start, max_q):
        return paged_attention(q[rows], kc, vc, positions[rows].to(DEV), start.to(DEV), lens.to(DEV), tbl.to(DEV),
                               page, d**-0.5, max_q, causal=True, batch_invariant=True, max_kv_len=int(lens.max()))

    batched = attend(slice(None), kv_lens, tables, qs, max(q_lens))
    for i, c in enumerate(ctx_lens):
        for j in range(q_lens[i]):
            row = int(qs[i]) + j
            alone = attend(slice(row, row + 1), torch.tensor([c + j + 1]), tables[i:i + 1], torch.tensor([0, 1]), 1)
            assert torch.equal(alone[0], batched[row]), (i, j)


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", False)
    with pytest.raises(BlockspecError, match=r"batch_invariant=True \(--batch-invariant\) .* needs a CUDA device, "
                                             r"got 'cpu'"):
        load_model(None, LoadConfig(device="cpu", batch_invariant=True))
    with pytest.raises(BlockspecError, match="exclude each other"):
        load_model(None, LoadConfig(device="cpu", batch_invariant=True, cpu_packed=True))


def test_cli_flag_on_cpu_names_the_flag_and_the_device(capsys, monkeypatch):
    from errors_utils import run_cli

    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", False)
    _, msg = run_cli(capsys, "--device", "cpu", "--prompt-ids", "1,2", "--batch-invariant")
    assert msg.startswith("batch_invariant=True (--batch-invariant) runs Triton kernels and needs a CUDA device, "
                          "got 'cpu'"), msg


def test_torch_attention_backend_and_tensor_parallel_are_refused():
    with pytest.raises(ConfigError, match="batch-invariant target needs attention_backend='triton'.*got 'torch'"):
        get_backend("torch", torch.device("cpu"), batch_invariant=True)
    with pytest.raises(ConfigError, match="batch_invariant=True is not supported with tensor_parallel_size > 1"):
        LLM(None, load=LoadConfig(batch_invariant=True), engine=EngineConfig(tensor_parallel_size=2))


def test_make_batch_invariant_keeps_parameters_and_ties():
    from trained_pair import trained_pair

    model = copy.deepcopy(trained_pair().lm.model)
    head = model.lm_head.weight
    n_params = sum(p.numel() for p in model.parameters())
    make_batch_invariant(model)
    assert isinstance(model.lm_head, InvariantLinear) and model.lm_head.weight is head
    assert isinstance(model.layers[0].self_attn.qkv_proj, InvariantLinear)
    assert sum(p.numel() for p in model.parameters()) == n_params


def _invariant_pair(dtype: torch.dtype):
    from trained_pair import trained_pair

    pair = trained_pair()
    model = copy.deepcopy(pair.lm.model).to(DEV, dtype)
    make_batch_invariant(model)
    lm = dataclasses.replace(pair.lm, model=model, plan=dataclasses.replace(pair.lm.plan, batch_invariant=True))
    return lm, dataclasses.replace(pair.draft, model=copy.deepcopy(pair.draft.model).to(DEV, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_spec_equals_plain_at_every_batch_size(dtype, monkeypatch):
    """Engine level: plain decoding one request at a time, plain decoding batched, and speculative decoding batched
    (verify rows, CUDA graphs on GPU) give the same tokens."""
    from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

    if not CUDA:
        if not INTERPRETED:
            pytest.skip("needs CUDA or Triton's interpreter")
        monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    lm, draft = _invariant_pair(dtype)
    prompts = [cycle_seq((CYCLE_A, CYCLE_B)[i % 2], 3 * i, 5 + 7 * i) for i in range(6 if CUDA else 3)]
    params = SamplingParams(max_tokens=48 if CUDA else 12, ignore_eos=True)

    def run(d, seqs):
        llm = LLM.from_loaded(lm, d,
                              engine=EngineConfig(max_num_seqs=seqs, block_size=8, attention_backend="triton",
                                                  enforce_eager=not CUDA))
        return llm.generate(prompts, params, use_tqdm=False)

    one = [o.token_ids for o in run(None, 1)]
    assert [o.token_ids for o in run(None, 4)] == one
    spec = run(draft, 4)
    assert [o.token_ids for o in spec] == one
    assert max(max(o.acceptance_lengths) for o in spec) > 2  # real verify blocks ran
