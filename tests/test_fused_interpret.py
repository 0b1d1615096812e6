"""The models' fused Triton code paths on CPU, under the Triton interpreter (kernels.INTERPRET_ON_CPU): the target's
prologue writing k/v into the paged pool, add+norm, silu*mul, rotary, taps from the fused adds, and the drafter's
packed q/k/v with its context K/V written by the kernel. Tokens and acceptance lengths must equal the torch path's
(fp32), so the model-level use of the kernels is checked without a GPU."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU machine the kernels compile for CUDA: tests/test_gpu.py
    pytest.skip("needs Triton's interpreter (set on machines without CUDA)", allow_module_level=True)
from blockspec.config import EngineConfig
from blockspec.layers import kernels, triton_qkv  # noqa: E402
from blockspec.llm import LLM  # noqa: E402
from blockspec.sampling import SamplingParams  # noqa: E402


def _run(pair, fused: bool, monkeypatch):
    from trained_pair import CYCLE_A, CYCLE_B, cycle_seq

    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", fused)
    calls: list[tuple[int, bool]] = []  # (q heads, writes k/v into the pool) of each fused prologue call
    spy = triton_qkv.split_qkv_norm_rope

    def recorded(qkv, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos, sin, paged=None):
        calls.append((heads, paged is not None))
        return spy(qkv, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos, sin, paged)

    monkeypatch.setattr(triton_qkv, "split_qkv_norm_rope", recorded)
    llm = LLM.from_loaded(pair.lm, pair.draft,
                          engine=EngineConfig(max_num_seqs=4, block_size=8, enforce_eager=True,
                                              attention_backend="triton" if fused else "torch"))
    prompts = [cycle_seq((CYCLE_A, CYCLE_B)[i % 2], 3 * i, 5 + 7 * i) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    return [(o.token_ids, o.acceptance_lengths) for o in outs], set(calls)


def test_fused_paths_under_the_interpreter_equal_the_torch_path(monkeypatch):
    from trained_pair import trained_pair

    pair = trained_pair()
    ref, unfused = _run(pair, False, monkeypatch)
    got, fused = _run(pair, True, monkeypatch)
    assert not unfused
    heads = pair.draft.config.num_attention_heads
    # the drafter's packed q/k/v really ran fused: its block (not stored) and its context k/v written into the pool
    assert {(heads, False), (0, True)} <= fused
    assert got == ref
    assert max(max(a) for _, a in ref) > 3  # real acceptance


def test_fused_draft_prologue_under_the_interpreter(monkeypatch):
    """The drafter's fused prologue on CPU under the interpreter (tests/test_gpu.py runs the same check on CUDA)."""
    import torch

    from dflash_utils import check_fused_draft_prologue
    from trained_pair import trained_pair

    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    check_fused_draft_prologue(trained_pair().draft.model, "cpu", torch.float32, 1e-5)
