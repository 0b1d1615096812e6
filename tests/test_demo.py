"""`blockspec demo` (the README's main command) on the real bundled SmolLM2: with a drafter it streams the speculative
answers and reports tau, tok/s and the speedup over plain decoding from the same run; without one it says so and
decodes plainly. A random 1-layer drafter stands in for the bundled one here (tau 1: it never hits)."""

from __future__ import annotations

import re

import pytest

import blockspec.loading.bundled_draft as bundled_draft
from blockspec.config import EngineConfig
from blockspec.demo import CPU_DRAFT_TOKENS, CPU_DRAFT_VOCAB, DEMO_PROMPTS, run_demo
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


def test_the_bundled_drafter_is_lossless_and_accepted():
    """The shipped drafter itself (z-lab format, loaded as-is) on the bundled target, fp32 CPU: greedy speculative
    output equals plain decoding token for token, and it is a trained drafter (a random one accepts nothing). The
    same with the drafter in bf16 on oneDNN-packed weights, and over the oneDNN-packed target with the demo's K,
    full-block drafting and draft vocabulary: still lossless, still accepted."""
    import torch

    from blockspec.config import SpeculativeConfig
    from blockspec.layers import cpu_packed
    from blockspec.llm import LLM
    from blockspec.loading.draft_loader import load_draft
    from blockspec.loading.loader import LoadConfig, load_model
    from blockspec.sampling import SamplingParams

    lm = load_model(None, LoadConfig(device="cpu"))
    path = bundled_draft.bundled_draft_path()
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": DEMO_PROMPTS[0]}])
    params = SamplingParams(max_tokens=48)
    plain = LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=1)).generate([ids], params, use_tqdm=False)[0]
    bf16 = [True] if cpu_packed.bf16_supported(torch.device("cpu")) else []
    for cpu_bf16 in [False, *bf16]:
        draft = load_draft(SpeculativeConfig(draft_model=str(path), num_draft_tokens=15, cpu_bf16_draft=cpu_bf16), lm)
        assert draft.config.block_size == 16 and draft.spec.target_layer_ids == [1, 8, 14, 20, 27]
        assert draft.model.dtype == (torch.bfloat16 if cpu_bf16 else torch.float32)
        spec = LLM.from_loaded(lm, draft,
                               engine=EngineConfig(max_num_seqs=1)).generate([ids], params, use_tqdm=False)[0]
        assert spec.token_ids == plain.token_ids, cpu_bf16
        acc = spec.acceptance_lengths
        assert sum(acc) / len(acc) > 1.5, (cpu_bf16, acc)
    if cpu_packed.fp32_supported(torch.device("cpu")):  # the demo's set-up: packed target, its K and draft rows
        lm = load_model(None, LoadConfig(device="cpu", cpu_packed=True))
        one = EngineConfig(max_num_seqs=1)
        assert LLM.from_loaded(lm, None, engine=one).generate([ids], params, use_tqdm=False)[0].token_ids == \
            plain.token_ids
        draft = load_draft(SpeculativeConfig(draft_model=str(path), num_draft_tokens=CPU_DRAFT_TOKENS,
                                             full_block_drafting=True, cpu_bf16_draft=bool(bf16),
                                             draft_vocab_size=CPU_DRAFT_VOCAB), lm)
        spec = LLM.from_loaded(lm, draft,
                               engine=EngineConfig(max_num_seqs=1)).generate([ids], params, use_tqdm=False)[0]
        assert spec.token_ids == plain.token_ids
        assert sum(spec.acceptance_lengths) / len(spec.acceptance_lengths) > 1.5, spec.acceptance_lengths


def test_demo_fp32_draft_keeps_the_drafter_in_fp32(tmp_path, monkeypatch, capsys):
    """--fp32-draft: the set-up of CPUs without bf16 units, on any CPU (the load line says which drafter runs)."""
    import torch

    from blockspec.cli import main
    from blockspec.layers import cpu_packed
    from blockspec.loading.bundled import bundled_default_path
    from blockspec.loading.source import resolve_source
    from blockspec.models.config import ModelConfig

    src = resolve_source(str(bundled_default_path()))
    init_draft(ModelConfig.from_hf(src.config, "bundled"), tmp_path / "d", 1, 16, None, 0)
    monkeypatch.setattr(bundled_draft, "BUNDLED_DRAFT_DIR", tmp_path / "d")
    assert main(["demo", "--max-tokens", "2", "--fp32-draft"]) == 0
    err = capsys.readouterr().err
    packed = " (fp32, oneDNN-packed)" if cpu_packed.fp32_supported(torch.device("cpu")) else ""
    assert f"+ the bundled DFlash drafter{packed} in " in err
    if cpu_packed.bf16_supported(torch.device("cpu")):
        assert main(["demo", "--max-tokens", "2"]) == 0
        assert "+ the bundled DFlash drafter (bf16, oneDNN-packed) in " in capsys.readouterr().err
