"""The models' fused Triton code paths on CPU, under the Triton interpreter (kernels.INTERPRET_ON_CPU): the target's
prologue writing k/v into the paged pool, add+norm, silu*mul, rotary, taps from the fused adds, and the drafter's
packed q/k/v with its context K/V written by the kernel. Tokens and acceptance lengths must equal the torch path's
(fp32), so the model-level use of the kernels is checked without a GPU."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU machine the kernels compile for CUDA: tests/test_gpu.py
    pytest.skip("needs Triton's interpreter (set on machines without CUDA)", allow_module_level=True)
from blockspec.layers import kernels  # noqa: E402
from blockspec.llm import LLM  # noqa: E402
from blockspec.sampling import SamplingParams  # noqa: E402


def _run(pair, fused: bool, monkeypatch):
    from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", fused)
    draft = dataclasses.replace(pair.draft, model=copy.deepcopy(pair.draft.model))  # fuse_qkv repacks it
    llm = LLM.from_loaded(pair.lm, draft, max_num_seqs=4, block_size=8, enforce_eager=True,
                          attention_backend="triton" if fused else "torch")
    prompts = [cycle_seq((CYCLE_A, CYCLE_B)[i % 2], 3 * i, 5 + 7 * i) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    return [(o.token_ids, o.acceptance_lengths) for o in outs], draft.model


def test_fused_paths_under_the_interpreter_equal_the_torch_path(monkeypatch):
    from trained_pair import trained_pair

    pair = trained_pair()
    ref, unfused = _run(pair, False, monkeypatch)
    got, fused = _run(pair, True, monkeypatch)
    assert unfused.layers[0].self_attn.qkv_weight is None
    assert fused.layers[0].self_attn.qkv_weight is not None  # the packed drafter path really ran
    assert got == ref
    assert max(max(a) for _, a in ref) > 3  # real acceptance


def test_fused_draft_prologue_under_the_interpreter(monkeypatch):
    """fuse_qkv on CPU under the interpreter: the packed block projection + kernel and the context K/V (contiguous,
    and written into a paged pool with slot -1 skipped) equal the unfused path."""
    import torch

    from trained_pair import trained_pair

    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    m = copy.deepcopy(trained_pair().draft.model)
    attn = m.layers[0].self_attn
    x = torch.randn(7, m.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = m.rotary.cos_sin(torch.arange(3, 10), x.dtype)
    seen: list[tuple[torch.Tensor, ...]] = []

    def capture(layer, q, k, v, scale, causal, window):
        seen.append((q, k, v))
        return q

    with torch.no_grad():
        ref_kv, ref_out = attn.kv(x, cos, sin), attn(x, cos, sin, capture)
        m.fuse_qkv()
        kv, out = attn.kv(x, cos, sin), attn(x, cos, sin, capture)
        kc = torch.zeros(12, *kv[0].shape[1:])
        vc = torch.zeros_like(kc)
        slots = torch.tensor([4, -1, 0, 11, 7, 2, -1])
        assert attn.kv(x, cos, sin, paged=(kc, vc, slots)) == (None, None)
    ok = slots >= 0
    assert torch.equal(kc[slots[ok]], kv[0][ok]) and torch.equal(vc[slots[ok]], kv[1][ok])
    assert (kc.abs().sum((1, 2)) > 0).sum() == int(ok.sum())  # nothing written for slot -1
    for a, b in [*zip(ref_kv, kv), *zip(seen[0], seen[1]), (ref_out, out)]:
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
