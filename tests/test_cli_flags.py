"""The command line's shared flags: the speculative and engine flags are the SpeculativeConfig / EngineConfig fields
of the same names and reach them, a drafter flag without --draft is one line, a command whose optional extra is
missing says which extra in one line, and `blockspec --help` imports no heavy module."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from blockspec.cli import generate, main, serve
from blockspec.cli.config_flags import flag_fields
from blockspec.cli.extras import EXTRAS
from blockspec.cli.flags import engine_config, speculative_config
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import BlockspecError
from hf_utils import make_hf_model, save_hf_model

# every flag of the two groups, with a value other than the field's default, and that value in the config
SPECULATIVE = {"num_draft_tokens": (["--num-draft-tokens", "3"], 3),
               "probabilistic_drafting": (["--probabilistic-drafting"], True),
               "full_block_drafting": (["--full-block-drafting"], True),
               "cpu_bf16_draft": (["--cpu-bf16-draft"], True),
               "draft_vocab_size": (["--draft-vocab-size", "64"], 64)}
ENGINE = {"max_num_seqs": (["--max-num-seqs", "3"], 3),
          "max_num_batched_tokens": (["--max-num-batched-tokens", "256"], 256),
          "block_size": (["--kv-block-size", "8"], 8),
          "num_kv_blocks": (["--num-kv-blocks", "40"], 40),
          "kv_cache_tokens": (["--kv-cache-tokens", "512"], 512),
          "max_model_len": (["--max-model-len", "100"], 100),
          "enable_prefix_caching": (["--no-prefix-caching"], False),
          "draft_len_schedule": (["--draft-len-schedule", "1:7,16:3"], {1: 7, 16: 3}),
          "attention_backend": (["--attention-backend", "torch"], "torch"),
          "enforce_eager": (["--enforce-eager"], True),
          "overlap": (["--no-overlap"], False)}


def parse(add_args, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("field", SPECULATIVE)
def test_each_speculative_flag_sets_its_field(field):
    flag, value = SPECULATIVE[field]
    args = parse(generate.add_args, "--prompt", "x", "--draft", "d", *flag)
    assert speculative_config(args) == SpeculativeConfig(draft_model="d", **{field: value})


def test_the_method_flags_set_their_fields():
    args = parse(generate.add_args, "--prompt", "x", "--speculative-method", "ngram", "--ngram-max", "4",
                 "--num-draft-tokens", "6")  # ngram: no --draft
    assert speculative_config(args) == SpeculativeConfig(method="ngram", ngram_max=4, num_draft_tokens=6)
    args = parse(generate.add_args, "--prompt", "x", "--draft", "d", "--speculative-method", "draft-model")
    assert speculative_config(args) == SpeculativeConfig(draft_model="d", method="draft-model")


@pytest.mark.parametrize("argv, message", [
    (["--speculative-method", "ngram", "--draft", "d"], "--draft: draft_model='d' does not go with method='ngram'"),
    (["--speculative-method", "draft-model"], "--speculative-method needs --draft"),
    (["--ngram-max", "2"], "--ngram-max needs --speculative-method ngram"),
    (["--draft", "d", "--ngram-max", "2"], "--ngram-max needs --speculative-method ngram"),
    (["--speculative-method", "ngram", "--ngram-max", "0"], "--ngram-max: ngram_max=0 must be an integer >= 1"),
    (["--speculative-method", "ngram", "--full-block-drafting"],
     "--full-block-drafting: full_block_drafting=True applies to DFlash drafters only, not to method 'ngram'"),
    (["--draft", "d", "--speculative-method", "draft-model", "--draft-vocab-size", "8"],
     "--draft-vocab-size: draft_vocab_size=8 applies to DFlash drafters only, not to method 'draft-model'"),
])
def test_bad_method_combinations_are_one_line_naming_the_flag(argv, message):
    args = parse(generate.add_args, "--prompt", "x", *argv)
    with pytest.raises(BlockspecError) as e:
        speculative_config(args)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("field", ENGINE)
def test_each_engine_flag_sets_its_field(field):
    flag, value = ENGINE[field]
    config = engine_config(parse(serve.add_args, *flag))
    assert config == {field: value}
    assert getattr(EngineConfig(**config), field) == value


def test_the_groups_cover_the_flags_and_leave_the_defaults():
    serve_args = parse(serve.add_args)
    assert speculative_config(serve_args) is None and engine_config(serve_args) == {}
    # the flags generate and bench share with the engine, under generate's names
    args = parse(generate.add_args, "--prompt", "x", "--max-batch-size", "5", "--enforce-eager", "--no-overlap",
                 "--tensor-parallel-size", "2")
    assert engine_config(args) == {"max_num_seqs": 5, "enforce_eager": True, "overlap": False,
                                   "tensor_parallel_size": 2}
    # the tables above name every flag of the two groups (a flag left out of them would go untested)
    assert {f.name for f in flag_fields(SpeculativeConfig)} == set(SPECULATIVE) | {"draft_model", "method",
                                                                                   "ngram_max"}
    assert {f.name for f in flag_fields(EngineConfig)} == set(ENGINE) | {"tensor_parallel_size"}


@pytest.mark.parametrize("extra, listed", [
    (["--num-draft-tokens", "3"], "--num-draft-tokens needs"),
    (["--trace"], "--trace needs"),
    (["--full-block-drafting", "--draft-vocab-size", "8", "--trace"],
     "--full-block-drafting, --draft-vocab-size and --trace need"),
])
def test_drafter_flags_without_draft_are_one_line(tmp_path, capsys, extra, listed):
    # the flags are checked before anything loads: the model need only look like one (loading it would fail)
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", *extra]) == 2
    assert capsys.readouterr().err == f"blockspec: error: {listed} --draft\n"


@pytest.mark.parametrize("command, module, extra", [
    (["serve", "--port", "0"], "uvicorn", "serve"),
    (["eval-draft", "--dataset", "gsm8k"], "matplotlib", "eval"),
])
def test_a_missing_extra_is_one_line(monkeypatch, capsys, command, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what `import module` meets when the package is not installed
    assert main(command) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"blockspec: error: `blockspec {command[0]}` needs the '{extra}' extra ({module} not "
                                 f"installed): pip install 'blockspec[{extra}]'\n")


def test_the_extras_table_follows_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    for extra, modules in EXTRAS.items():
        packages = [re.match(r"[\w.-]+", r).group() for r in project["optional-dependencies"][extra]]
        assert tuple(packages) == modules


def test_chat_runs_without_the_server_stack(tmp_path, monkeypatch, capsys):
    plain = save_hf_model(make_hf_model("llama"), tmp_path / "plain")  # no tokenizer files: chat stops at the model
    capsys.readouterr()
    for module in EXTRAS["serve"]:
        monkeypatch.setitem(sys.modules, module, None)
    assert main(["chat", str(plain), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (f"blockspec: error: {plain} has no chat template: `blockspec chat` needs a "
                                       f"chat model\n")


def test_help_imports_no_command():
    code = ("import sys\nfrom blockspec.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'blockspec.config', 'blockspec.cli.flags') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"
