"""Bad combinations of the speculative methods (ngram, draft-model) fail with one clear line naming the field, through
the API (SpeculativeConfig, LLM, load_proposer) and through `blockspec generate` (exit 2, `blockspec: error: ...`),
before anything heavy happens. The flag-level messages of argument parsing are tests/test_cli_flags.py's."""

from __future__ import annotations

import multiprocessing

import pytest

import blockspec.distributed.launch
import blockspec.llm
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.errors import ConfigError
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig
from blockspec.speculative.registry import load_proposer
from errors_utils import gen
from hf_utils import make_hf_model, save_hf_model
from proposer_utils import TINY, VOCAB
from proposer_utils import ckpts  # noqa: F401 - a fixture, used by name

DFLASH_ONLY = {"mask_token_id": 3, "target_layer_ids": [0], "full_block_drafting": True, "cpu_bf16_draft": True,
               "draft_vocab_size": 8, "probabilistic_drafting": True}


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A causal LM of the target's shape with 96 tokens instead of 128."""
    return save_hf_model(make_hf_model("llama", seed=5, **{**TINY, "vocab_size": 96}),
                         tmp_path_factory.mktemp("small_vocab") / "draft")


def one_line(e: pytest.ExceptionInfo, field: str) -> str:
    assert isinstance(e.value, ConfigError) and e.value.field == field, (type(e.value), getattr(e.value, "field", None))
    message = str(e.value)
    assert message and "\n" not in message
    return message


@pytest.fixture
def no_processes(monkeypatch):
    """Fails the test if a tensor-parallel session would start or the target would load."""
    def refuse(*args, **kwargs):
        raise AssertionError("started before the combination was checked")

    monkeypatch.setattr(blockspec.distributed.launch, "TensorParallelSession", refuse)
    monkeypatch.setattr(blockspec.llm, "load_model", refuse)
    yield
    assert multiprocessing.active_children() == []


CONFIG_ERRORS = [
    (dict(method="ngram", draft_model="d"), "draft_model",
     "draft_model='d' does not go with method='ngram' (prompt lookup has no draft model)"),
    (dict(method="draft-model"), "draft_model", "speculative draft_model is required for method 'draft-model'"),
    (dict(method="ngram", ngram_max=0), "ngram_max", "ngram_max=0 must be an integer >= 1"),
    (dict(method="ngram", ngram_max=-2), "ngram_max", "ngram_max=-2 must be an integer >= 1"),
    (dict(method="ngram", ngram_max=True), "ngram_max", "ngram_max=True must be an integer >= 1"),
    (dict(method="ngram", ngram_max=2.5), "ngram_max", "ngram_max=2.5 must be an integer >= 1"),
    (dict(method="draft-model", draft_model="d", ngram_max=2), "ngram_max",
     "ngram_max=2 applies to method 'ngram' only"),
    (dict(method="eagle", draft_model="d"), "method", "speculative method='eagle' is not supported (supported: "
                                                      "dflash, ngram, draft-model)"),
] + [
    ({"method": method, "draft_model": "d" if method == "draft-model" else None, name: value}, name,
     f"{name}={value!r} applies to DFlash drafters only, not to method {method!r}")
    for method in ("ngram", "draft-model") for name, value in DFLASH_ONLY.items()
]


@pytest.mark.parametrize("kwargs, field, message", CONFIG_ERRORS,
                         ids=[f"{k.get('method')}-{f}-{i}" for i, (k, f, _) in enumerate(CONFIG_ERRORS)])
def test_bad_speculative_config(ckpts, no_processes, kwargs, field, message):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig(**kwargs)
    assert one_line(e, field).startswith(message)
    with pytest.raises(ConfigError) as e:  # the same through LLM's dict form, before the target loads
        LLM(str(ckpts.target), speculative=kwargs, load=LoadConfig(device="cpu"))
    assert one_line(e, field).startswith(message)


@pytest.mark.parametrize("method", ["draft-model", None])  # None: taken from the checkpoint (a plain causal LM)
def test_draft_model_of_another_vocabulary(ckpts, small_vocab, method):
    with pytest.raises(ConfigError) as e:
        LLM(str(ckpts.target), speculative=dict(method=method, draft_model=str(small_vocab), num_draft_tokens=3),
            load=LoadConfig(device="cpu"))
    message = one_line(e, "draft_model")
    assert message.startswith(f"{small_vocab}: draft model vocab_size=96 differs from the target's vocab_size={VOCAB}")


def test_draft_model_needs_num_draft_tokens(ckpts):
    for spec in (SpeculativeConfig(method="draft-model", draft_model=str(ckpts.other)),
                 SpeculativeConfig(draft_model=str(ckpts.other))):
        with pytest.raises(ConfigError) as e:
            load_proposer(spec, ckpts.lm)
        assert one_line(e, "num_draft_tokens").startswith("num_draft_tokens is required with method 'draft-model'")


@pytest.mark.parametrize("method", ["ngram", "draft-model", None])
def test_tensor_parallel_takes_only_dflash(ckpts, no_processes, method):
    spec = {"method": method} if method == "ngram" else dict(method=method, draft_model=str(ckpts.other),
                                                             num_draft_tokens=3)
    with pytest.raises(ConfigError) as e:
        LLM(str(ckpts.target), speculative=spec, load=LoadConfig(device="cpu"),
            engine=EngineConfig(tensor_parallel_size=2))
    assert one_line(e, "method") == (f"speculative method {method or 'draft-model'!r} is not supported with "
                                     f"tensor_parallel_size > 1 (only 'dflash' drafters are sharded)")


# --------------------------------------------------------------------------------------------------------------
# through `blockspec generate`: exit 2, one line


def test_generate_draft_model_of_another_vocabulary(ckpts, small_vocab, capsys):
    for method in (["--speculative-method", "draft-model"], []):
        message = gen(capsys, ckpts.target, *method, "--draft", str(small_vocab), "--num-draft-tokens", "3")
        assert message.startswith(f"{small_vocab}: draft model vocab_size=96 differs from the target's "
                                  f"vocab_size={VOCAB}")


def test_generate_draft_model_without_num_draft_tokens(ckpts, capsys):
    message = gen(capsys, ckpts.target, "--draft", str(ckpts.other))
    assert message.startswith("num_draft_tokens is required with method 'draft-model'")


def test_generate_tensor_parallel_with_ngram(ckpts, no_processes, capsys):
    message = gen(capsys, ckpts.target, "--speculative-method", "ngram", "--tensor-parallel-size", "2")
    assert message.startswith("speculative method 'ngram' is not supported with tensor_parallel_size > 1")
