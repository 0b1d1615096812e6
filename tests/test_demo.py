"""`blockspec demo` (the README's main command) on the real bundled SmolLM2: with a drafter it streams the speculative
answers and reports tau, tok/s and the speedup over plain decoding from the same run; without one it says so and
decodes plainly. A random 1-layer drafter stands in for the bundled one here (tau 1: it never hits)."""

from __future__ import annotations

import re

import pytest

import blockspec.loading.bundled_draft as bundled_draft
from blockspec.demo import DEMO_PROMPTS, run_demo
from blockspec.train.export import init_draft

pytestmark = pytest.mark.smollm2


def test_demo_with_a_drafter(tmp_path, monkeypatch, capsys):
    from blockspec.loading.bundled import bundled_default_path
    from blockspec.loading.source import resolve_source
    from blockspec.models.config import ModelConfig

    src = resolve_source(str(bundled_default_path()))
    init_draft(ModelConfig.from_hf(src.config, "bundled"), tmp_path / "d", 1, 16, None, 0)
    monkeypatch.setattr(bundled_draft, "BUNDLED_DRAFT_DIR", tmp_path / "d")
    assert run_demo(max_tokens=6, num_draft_tokens=3) == 0
    out = capsys.readouterr().out
    assert out.count(">>> ") == len(DEMO_PROMPTS)
    per_prompt = re.findall(r"\[spec: 6 tokens in [\d.]+s = [\d.]+ tok/s, tau 1\.00 \| no-spec: [\d.]+ tok/s \| "
                            r"speedup [\d.]+x\]", out)
    assert len(per_prompt) == len(DEMO_PROMPTS)
    assert "warning" not in out
    assert re.search(r"DFlash speculative decoding: tau 1\.00, [\d.]+ tok/s vs [\d.]+ tok/s without speculation: "
                     r"[\d.]+x \(same outputs, measured in this run\)", out)


def test_demo_without_the_drafter(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bundled_draft, "BUNDLED_DRAFT_DIR", tmp_path / "missing")
    assert run_demo(max_tokens=4) == 0
    captured = capsys.readouterr()
    assert "the bundled SmolLM2-135M-Instruct DFlash drafter is not available" in captured.err
    assert re.search(r"plain decoding: [\d.]+ tok/s overall", captured.out)
