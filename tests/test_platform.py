"""The platform plan (blockspec/loading/platform.py): what runs the target and the drafter on this CPU for each load
flag combination, the fallbacks with their reasons, the CPU's drafting defaults shared by LLM and the commands,
`generate --explain`, the one stderr line every command that loads a target prints, and the plan's word on a native
build that is switched off or fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import BlockspecError, ConfigError
from blockspec.layers import cpu_packed, cpu_quant
from blockspec.llm import LLM
from blockspec.loading import platform as pf
from blockspec.loading.load_config import LoadConfig
from blockspec.loading.loader import load_model
from blockspec.loading.platform_report import explain, summary
from blockspec.native import lib
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model

CPU = torch.device("cpu")
NATIVE = lib.library() is not None
BF16 = cpu_packed.bf16_supported(CPU)
QUANT = [m for m in ("q4", "q8") if cpu_quant.supported(m, CPU)]
# a target the native stack takes (head_dim 32), and the default tiny one it does not (head_dim 16)
NATIVE_SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny llama target (head_dim 16) and a DFlash drafter for it."""
    root = tmp_path_factory.mktemp("platform")
    hf = make_hf_model("llama", seed=3)
    target = save_hf_model(hf, root / "t")
    make_zlab_draft(hf.config, root / "d", block_size=8, target_layer_ids=[0, 1])
    return target, root / "d"


def test_plain_and_packed_targets():
    p = pf.plan(LoadConfig(device="cpu"))
    assert (p.device, p.dtype, p.target, p.attention, p.drafter, p.native) == (
        "cpu", "float32", pf.PLAIN, "torch", pf.NO_DRAFTER, pf.NOT_USED)
    assert summary(p) == "blockspec: cpu, target float32, attention torch, no drafter"
    if cpu_packed.fp32_supported(CPU):
        assert pf.plan(LoadConfig(device="cpu", cpu_packed=True)).target == pf.PACKED
    else:
        with pytest.raises(BlockspecError, match=r"cpu_packed=True \(--cpu-packed\) needs a CPU with oneDNN"):
            pf.plan(LoadConfig(device="cpu", cpu_packed=True))


@pytest.mark.parametrize("mode", QUANT)
def test_quantized_targets_take_the_native_kernels_where_they_build(mode):
    p = pf.plan(LoadConfig(device="cpu", cpu_quant=mode))
    native = {"q4": pf.NATIVE_Q4, "q8": pf.NATIVE_Q8}[mode]
    torch_kernel = {"q4": pf.TORCH_INT4, "q8": pf.TORCH_INT8}[mode]
    assert p.cpu_quant == mode and p.attention == "rowwise" and p.row_invariant
    if NATIVE:
        assert p.target == native and p.native in pf.ISA.values() and not p.reasons
    else:
        assert p.target == torch_kernel and p.native == pf.NOT_BUILT
        assert p.reasons[0].startswith("native kernels not built: ")


def test_auto_resolves_and_says_so():
    p = pf.plan(LoadConfig(device="cpu", cpu_quant="auto"))
    assert p.cpu_quant == cpu_quant.resolve("auto", CPU)
    assert p.reasons[0].startswith(f"cpu_quant auto: {p.cpu_quant}")


def test_refusals_name_the_flag():
    with pytest.raises(ConfigError, match=r"cpu_quant='4bit' \(--cpu-quant\) is not one of auto, q8, q4, off"):
        pf.plan(LoadConfig(device="cpu", cpu_quant="4bit"))
    with pytest.raises(BlockspecError, match=r"batch_invariant=True \(--batch-invariant\) runs Triton kernels"):
        pf.plan(LoadConfig(device="cpu", batch_invariant=True))
    # tensor parallelism shards nn.Linear weights: the variants that replace them cannot be sharded
    for load, message in ((LoadConfig(device="cpu", cpu_packed=True), "cpu_packed=True is not supported"),
                          (LoadConfig(device="cpu", cpu_quant="auto"), "cpu_quant='auto' is not supported"),
                          (LoadConfig(device="cpu", batch_invariant=True), "batch_invariant=True is not supported")):
        with pytest.raises(ConfigError, match=f"^{message} with tensor_parallel_size > 1"):
            pf.plan(load, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"^speculative method 'ngram' is not supported with tensor_parallel_size"):
        pf.plan(LoadConfig(device="cpu"), {"method": "ngram"}, tensor_parallel_size=2)


def test_drafting_defaults_on_the_cpu(pair):
    _, draft = pair
    p = pf.plan(LoadConfig(device="cpu"), {"draft_model": str(draft)})
    assert p.method == "dflash" and p.full_block_drafting and p.speculative.full_block_drafting is True
    assert p.cpu_bf16_draft is BF16 and p.speculative.cpu_bf16_draft is (True if BF16 else None)
    assert p.drafter == (pf.DRAFT_BF16 if BF16 else pf.DRAFT_PLAIN)
    # what the user set stays as set; a bf16 drafter is a default only beside an fp32 target on one device
    given = pf.plan(LoadConfig(device="cpu"), SpeculativeConfig(draft_model=str(draft), full_block_drafting=False,
                                                               cpu_bf16_draft=False))
    assert not given.full_block_drafting and not given.cpu_bf16_draft and given.drafter == pf.DRAFT_PLAIN
    assert not pf.plan(LoadConfig(device="cpu", dtype="bfloat16"), {"draft_model": str(draft)}).cpu_bf16_draft
    tp = pf.plan(LoadConfig(device="cpu"), {"draft_model": str(draft)}, tensor_parallel_size=2)
    assert tp.full_block_drafting and not tp.cpu_bf16_draft
    ngram = pf.plan(LoadConfig(device="cpu"), {"method": "ngram"})
    assert ngram.drafter == pf.DRAFT_NGRAM and ngram.speculative == SpeculativeConfig(method="ngram")


def test_llm_and_the_commands_share_the_defaults(pair, capsys):
    target, draft = pair
    llm = LLM(str(target), load=LoadConfig(device="cpu", with_tokenizer=False), speculative={"draft_model": str(draft)},
              engine=EngineConfig(draft_len_schedule="off"))
    assert llm.plan.full_block_drafting and llm.plan.cpu_bf16_draft is BF16
    assert llm.engine.proposer.spec.full_block_drafting
    argv = ["generate", "--model", str(target), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--device", "cpu",
            "--draft", str(draft), "--draft-len-schedule", "off", "--json"]
    assert main(argv) == 0
    lines = capsys.readouterr().err.splitlines()
    plan_lines = [ln for ln in lines if ln.startswith("blockspec: cpu,")]
    assert plan_lines == [summary(llm.plan)]  # one line, the LLM's plan
    assert plan_lines[0].endswith(f"drafter {llm.plan.drafter}, full-block drafting")


def test_every_loading_command_prints_one_plan_line(pair, capsys):
    target, _ = pair
    assert main(["generate", "--model", str(target), "--prompt-ids", "1,2", "--max-tokens", "2", "--device",
                 "cpu"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [ln for ln in err if ln.startswith("blockspec: ")] == [
        "blockspec: cpu, target float32, attention torch, no drafter"]


def test_explain_prints_the_plan_and_generates_nothing(pair, capsys):
    target, draft = pair
    assert main(["generate", "--model", str(target), "--explain", "--device", "cpu", "--draft", str(draft)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("platform plan:\n") and "token_ids" not in out and err == ""
    rows = dict(line.strip().split(None, 1) for line in out.splitlines()[1:] if not line.startswith(("why", "  -")))
    assert rows["target"].startswith("float32: the linears as loaded")
    assert rows["attention"].startswith("torch")
    assert rows["drafter"].startswith((pf.DRAFT_BF16 if BF16 else pf.DRAFT_PLAIN) + " (dflash)")
    assert rows["drafting"].startswith("full-block drafting")
    assert "full-block drafting: the CPU default for a DFlash drafter (full_block_drafting unset)" in out


@pytest.mark.skipif("q4" not in QUANT or not NATIVE, reason="the native q4 kernels do not build here")
def test_the_native_stack_is_decided_at_load_with_its_reason(pair, tmp_path):
    target, _ = pair
    lm = load_model(str(target), LoadConfig(device="cpu", cpu_quant="q4", with_tokenizer=False))
    assert lm.plan.target == pf.NATIVE_Q4  # the tiny target's heads are 16 wide: the stack takes whole blocks of 32
    assert lm.plan.reasons == ("q4 requested: native stack not used: head_dim 16 is not a multiple of 32; its "
                               "linears run on the native kernel",)
    src = save_hf_model(make_hf_model("llama", seed=11, **NATIVE_SHAPE), tmp_path / "t")
    lm = load_model(str(src), LoadConfig(device="cpu", cpu_quant="q4", with_tokenizer=False))
    assert lm.plan.target == pf.NATIVE_STACK and not lm.plan.reasons
    assert summary(lm.plan).startswith(f"blockspec: cpu, target q4 on the native stack ({lm.plan.native}), "
                                       f"attention rowwise")
    make_zlab_draft(make_hf_model("llama", seed=11, **NATIVE_SHAPE).config, tmp_path / "d", block_size=8,
                    target_layer_ids=[0, 1], head_dim=32, intermediate_size=96, mask_token_id=95)
    llm = LLM.from_loaded(lm, pf_draft(tmp_path / "d", lm))
    assert llm.plan.drafter == pf.DRAFT_NATIVE, llm.plan.reasons
    assert "drafter native Q8" in summary(llm.plan)


def pf_draft(path: Path, lm):
    from blockspec.loading.draft_loader import load_draft

    return load_draft(SpeculativeConfig(draft_model=str(path)), lm)


@pytest.mark.parametrize("env, why", [
    ({"BLOCKSPEC_NATIVE": "0"}, "BLOCKSPEC_NATIVE=0"),
    ({"CC": "false"}, "false"),  # a fresh cache: the build is tried with that compiler, and fails
])
def test_a_native_build_switched_off_or_failing_is_explained(pair, tmp_path, env, why):
    target, _ = pair
    run = subprocess.run([sys.executable, "-m", "blockspec", "generate", "--model", str(target), "--explain",
                          "--device", "cpu", "--cpu-quant", "auto"], capture_output=True, text=True,
                         env={**os.environ, "BLOCKSPEC_CACHE_DIR": str(tmp_path), **env})
    assert run.returncode == 0, run.stderr
    assert "  native     not built" in run.stdout
    assert why in next(line for line in run.stdout.splitlines() if line.startswith("  - native kernels not built: "))


def test_a_drafter_names_its_cpu_draft_vocabulary(tmp_path):
    """The bundled drafter's config names cpu_draft_vocab_size: on the CPU an unset draft_vocab_size takes it (with a
    reason); a value given, probabilistic drafting, or the GPU keep their own."""
    import json
    import shutil

    from blockspec.config import SpeculativeConfig
    from blockspec.loading import platform
    from blockspec.loading.bundled_draft import bundled_draft_path
    from blockspec.loading.load_config import LoadConfig

    src = bundled_draft_path()
    spec = SpeculativeConfig(draft_model=str(src))
    plan = platform.plan(LoadConfig(device="cpu"), spec)
    assert plan.speculative.draft_vocab_size == 24576
    assert any("cpu_draft_vocab_size" in r for r in plan.reasons)
    given = platform.plan(LoadConfig(device="cpu"), SpeculativeConfig(draft_model=str(src), draft_vocab_size=1000))
    assert given.speculative.draft_vocab_size == 1000
    sampled = SpeculativeConfig(draft_model=str(src), probabilistic_drafting=True)
    assert platform.plan(LoadConfig(device="cpu"), sampled).speculative.draft_vocab_size is None
    plain = shutil.copytree(src, tmp_path / "d", ignore=shutil.ignore_patterns("model.safetensors"))
    (plain / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["cpu_draft_vocab_size"]
    (plain / "config.json").write_text(json.dumps(cfg))
    unnamed = SpeculativeConfig(draft_model=str(plain))
    assert platform.plan(LoadConfig(device="cpu"), unnamed).speculative.draft_vocab_size is None
