"""kernel_compiles: the names of the Triton kernels compiled inside a block, through Triton's cache hook, leaving
any hook set before it working and in place afterwards."""

from __future__ import annotations

import pytest

from blockspec.evaluation.compile_watch import kernel_compiles

knobs = pytest.importorskip("triton").knobs


class Info:  # what Triton passes as `fn` (its JitFunctionInfo: module, name, jit_function)
    name = "_paged_attn_kernel"


def test_counts_compiles_inside_the_block_and_chains_the_previous_hook(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["fn"].name))
    before = knobs.runtime.jit_cache_hook
    with kernel_compiles() as compiled:
        assert knobs.runtime.jit_cache_hook(key="k", repr="_paged_attn_kernel[...]", fn=Info(), compile={},
                                            is_manual_warmup=False, already_compiled=False) is None
    assert compiled == ["_paged_attn_kernel"] and seen == ["_paged_attn_kernel"]
    assert knobs.runtime.jit_cache_hook is before


def test_nothing_recorded_outside_and_hook_restored_after_an_error(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    with pytest.raises(RuntimeError), kernel_compiles() as compiled:
        raise RuntimeError("boom")
    assert compiled == [] and knobs.runtime.jit_cache_hook is None
