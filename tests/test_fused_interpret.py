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
    """fuse_qkv on CPU under the interpreter (tests/test_gpu.py runs the same check on CUDA)."""
    import torch

    from dflash_utils import check_fused_draft_prologue
    from trained_pair import trained_pair

    monkeypatch.setattr(kernels, "INTERPRET_ON_CPU", True)
    check_fused_draft_prologue(copy.deepcopy(trained_pair().draft.model), "cpu", torch.float32, 1e-5)
