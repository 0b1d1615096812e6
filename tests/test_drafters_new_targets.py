"""DFlash drafters of the newer target families (issues 52 item 4, 53 item 3): Qwen3.5 / Qwen3.6 hybrids (dense and
MoE), gpt-oss and Gemma 4, on tiny random targets made by transformers, fp32 on CPU.

- z-lab drafter configs load as they are: target_layer_ids over ALL target layers (a hybrid's linear layers too),
  sliding-window draft layers (read as the z-lab package's class reads them, use_sliding_window included), the input
  embedding scale; a bad field fails in one line naming it.
- Our drafter == the z-lab package's, step by step as dflash_generate drives it (its cache cropped after each step),
  on each family, for plain, sliding (causal, windows shorter than the context) and scaled drafters: our context
  K/V through the paged pool from OUR target's taps, theirs from transformers' hidden states.
- `init-draft` and `train-draft` (fresh, and --init from init-draft's drafter) on each family; what they write
  loads in the z-lab package and drafts as ours does."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.cli import main
from blockspec.config import SpeculativeConfig
from blockspec.data.shards import TokenSequence, write_shards
from blockspec.errors import BlockspecError
from blockspec.loading.draft_loader import load_draft
from blockspec.models.dflash_config import QWEN3_DEFAULT_WINDOW, DFlashConfig, DraftConfigError
from dflash_utils import make_zlab_draft
from drafter_targets import (FULL, MASK, SLIDE, VOCAB, assert_same_drafts, check_flex_equals_sdpa, make_target,
                             our_steps, steps_over, zlab_steps)

zm = pytest.importorskip("dflash.model")

BLOCK = 6  # drafter block size: bonus + 5 drafts
ENDS = [14, 17, 24, 25, 31]  # each step's context end: accepted runs of 3, 7, 1 and 6 rows


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> (its directory, transformers' model, blockspec's LoadedModel), built once per family."""
    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            made[family] = (root, *make_target(family, root))
        return made[family]

    return get


def sequence(seed: int = 3, length: int = 40) -> torch.Tensor:
    return torch.randint(0, MASK, (length,), generator=torch.Generator().manual_seed(seed))


# drafters the z-lab class writes itself (tests/dflash_utils.py): taps at every layer kind incl. the last (final-
# normed), causal sliding layers with windows far shorter than the context, a non-causal window, Gemma-style scales
VARIANTS = {
    "plain": dict(target_layer_ids=[0, 1, 3]),
    "sliding": dict(target_layer_ids=[1, 3], layer_types=[SLIDE, FULL], sliding_window=4,
                    input_embedding_scale=8.0, final_logit_softcapping=5.0),
    "sliding_noncausal": dict(target_layer_ids=[2], layer_types=[SLIDE, SLIDE], sliding_window=3, is_causal=False),
}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma4"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_equals_the_zlab_package_step_by_step(targets, tmp_path, family, variant):
    root, hf, lm = targets(family)
    zd = make_zlab_draft(hf.config, tmp_path / "d", block_size=BLOCK, mask_token_id=MASK, scale=3.0,
                         **VARIANTS[variant])
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)
    assert draft.spec.target_layer_ids == VARIANTS[variant]["target_layer_ids"]
    for layer, ref in zip(draft.model.layers, zd.layers):  # the attention pattern the z-lab class runs
        assert (layer.self_attn.causal, layer.self_attn.window) == (ref.self_attn.is_causal,
                                                                    ref.self_attn.sliding_window)
    seq = sequence()
    steps = steps_over(seq, ENDS)
    assert_same_drafts(our_steps(draft, lm, seq, steps, BLOCK), zlab_steps(zd, hf, seq, steps, BLOCK))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "gpt_oss", "gemma4"])
def test_the_engine_drafts_what_the_zlab_package_drafts(targets, tmp_path, family):
    """Greedy DFlash through the batched engine with a sliding drafter: every step's drafts (the engine's trace) are
    the argmax of the z-lab drafter's logits at that step's context (it drafts from transformers' hidden states)."""
    from blockspec.config import EngineConfig
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    from drafter_targets import Step

    root, hf, lm = targets(family)
    zd = make_zlab_draft(hf.config, tmp_path / "d", block_size=BLOCK, mask_token_id=MASK, scale=3.0,
                         **VARIANTS["sliding"])
    draft = load_draft(SpeculativeConfig(draft_model=str(tmp_path / "d")), lm)
    prompt = [5, 17, 99, 3, 42, 8, 1, 9, 60]
    out = LLM.from_loaded(lm, draft, engine=EngineConfig(max_num_seqs=1)).generate(
        [prompt], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    seq = torch.tensor(prompt + out.token_ids)
    full = [s for s in out.steps if len(s.draft) == BLOCK - 1]  # near max_tokens the engine drafts fewer
    assert len(full) >= 15
    ref = zlab_steps(zd, hf, seq, [Step(s.position, int(seq[s.position])) for s in full], BLOCK)
    assert [s.draft for s in full] == [r.argmax(-1).tolist() for r in ref]


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "gemma4"])
def test_padded_flex_training_pass_equals_sdpa(targets, family):
    """The trainer's CUDA attention path, eager on the CPU (tests/test_drafters_new_targets_gpu.py runs it compiled
    on CUDA)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention warns that it is not compiled
        check_flex_equals_sdpa(targets(family)[2], torch.device("cpu"), compiled=False)


def zlab_attention(cfg: dict) -> list[tuple[bool, int | None]]:
    """(is_causal, sliding_window) of each layer of the z-lab class, built from `cfg` as its from_pretrained does."""
    from transformers import Qwen3Config

    c = Qwen3Config.from_dict(cfg)
    return [(a.is_causal, a.sliding_window) for a in (zm.Qwen3DFlashAttention(c, i) for i in range(len(c.layer_types)))]


BASE = {"hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 1, 2, 3]}}
PATTERNS = [
    {"layer_types": [SLIDE, SLIDE, FULL], "sliding_window": 2048, "use_sliding_window": True},  # Qwen3.6 drafters
    {"layer_types": [SLIDE, FULL, SLIDE], "sliding_window": 5, "use_sliding_window": True, "is_causal": False},
    {"layer_types": [FULL, SLIDE, FULL], "use_sliding_window": True},  # Qwen3Config's own default window
    {"layer_types": [SLIDE, SLIDE, FULL], "sliding_window": None, "use_sliding_window": True},  # causal, no window
    {"layer_types": [FULL, FULL, FULL], "sliding_window": 7, "use_sliding_window": True, "is_causal": True},
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_attention_pattern_is_the_zlab_class_s(pattern):
    cfg = DFlashConfig.from_hf({**BASE, **pattern}, "d/config.json")
    assert list(zip(cfg.layer_causal, cfg.layer_window)) == zlab_attention({**BASE, **pattern})
    assert QWEN3_DEFAULT_WINDOW in cfg.layer_window or "sliding_window" in pattern


def test_a_window_without_use_sliding_window_is_kept_and_exported_for_the_zlab_package(targets, tmp_path):
    """transformers drops a window use_sliding_window does not enable; a config written outside transformers means
    it, so we keep it, and what we write says use_sliding_window: true (the z-lab class then runs it too)."""
    from blockspec.train.export import save_draft, zlab_readable

    pattern = {"layer_types": [SLIDE, FULL], "sliding_window": 4, "num_hidden_layers": 2}
    assert DFlashConfig.from_hf({**BASE, **pattern}, "x").layer_window == [4, None]
    assert zlab_attention({**BASE, **pattern}) == [(True, None), (False, None)]
    fixed = zlab_readable({**BASE, **pattern})
    assert zlab_attention(fixed) == [(True, 4), (False, None)] and fixed["use_sliding_window"] is True
    _, _, lm = targets("qwen3_5")
    cfg = {**BASE, **pattern, "intermediate_size": 32, "num_target_layers": 4}
    from blockspec.train.export import random_draft
    out = save_draft(random_draft(cfg), cfg, tmp_path / "d", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["use_sliding_window"] is True
    ref = zm.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32)
    assert [(a.self_attn.is_causal, a.self_attn.sliding_window) for a in ref.layers] == [(True, 4), (False, None)]
    assert load_draft(SpeculativeConfig(draft_model=str(out)), lm).config.layer_window == [4, None]


def test_dflash_config_wins_and_embedding_scale_is_read():
    cfg = DFlashConfig.from_hf({**BASE, "input_embedding_scale": 2.0, "final_logit_softcapping": 0,
                                "dflash_config": {**BASE["dflash_config"], "input_embedding_scale": 53.75}}, "x")
    assert cfg.input_embedding_scale == 53.75 and cfg.final_logit_softcapping is None  # a cap <= 0: none (z-lab)
    assert cfg.target_layer_ids == [0, 1, 2, 3] and cfg.mask_token_id == MASK


def test_hybrid_target_layer_ids_index_every_layer(targets, tmp_path):
    """A Qwen3.5 target's 4 layers are linear, linear, linear, full: ids 0..3 all tap, 4 does not exist."""
    root, hf, lm = targets("qwen3_5")
    assert hf.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    make_zlab_draft(hf.config, tmp_path / "ok", block_size=BLOCK, target_layer_ids=[0, 1, 2, 3])
    assert load_draft(SpeculativeConfig(draft_model=str(tmp_path / "ok")), lm).spec.target_layer_ids == [0, 1, 2, 3]
    make_zlab_draft(hf.config, tmp_path / "bad", block_size=BLOCK, target_layer_ids=[1, 4])
    with pytest.raises(BlockspecError, match=r"target_layer_ids=\[1, 4\] contains 4, but the target has only 4 layers"):
        load_draft(SpeculativeConfig(draft_model=str(tmp_path / "bad")), lm)


BAD = [
    ({"hidden_size": "64"}, "hidden_size", "must be an integer >= 1, got '64'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide num_attention_heads=4"),
    ({"layer_types": [FULL, FULL]}, "layer_types", "must list 3 entries"),
    ({"layer_types": [FULL, "linear_attention", FULL]}, "layer_types", "each 'full_attention' or 'sliding_attention'"),
    ({"layer_types": [SLIDE, FULL, FULL], "sliding_window": 0}, "sliding_window", "must be an integer >= 1, got 0"),
    ({"layer_types": [SLIDE, FULL, FULL], "sliding_window": "2k"}, "sliding_window", "got '2k'"),
    ({"layer_types": [SLIDE, FULL, FULL], "sliding_window": 8, "use_sliding_window": False}, "use_sliding_window",
     "is false beside sliding_window=8"),
    ({"layer_types": [SLIDE, FULL, FULL], "use_sliding_window": "yes"}, "use_sliding_window", "must be true or false"),
    ({"is_causal": 1}, "is_causal", "must be true or false, got 1"),
    ({"input_embedding_scale": 0}, "input_embedding_scale", "must be a positive finite number, got 0"),
    ({"dflash_config": {"input_embedding_scale": "sqrt"}}, "input_embedding_scale", "got 'sqrt'"),
    ({"output_multiplier": -1.0}, "output_multiplier", "must be a positive finite number"),
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping", "must be a finite number"),
    ({"dflash_config": {"target_layer_ids": "1,2"}}, "target_layer_ids", "must be a list of integer layer indices"),
    ({"dflash_config": {"mask_token_id": -1}}, "mask_token_id", "must be an integer >= 0, got -1"),
    ({"dflash_config": [1]}, "dflash_config", "must be an object"),
    ({"rope_theta": "big"}, "rope_theta", "is unusable"),
]


@pytest.mark.parametrize("edit, field, needle", BAD)
def test_bad_configs_fail_in_one_line_naming_the_field(edit, field, needle):
    cfg = {**BASE, **edit}
    if "dflash_config" in edit and isinstance(edit["dflash_config"], dict):
        cfg["dflash_config"] = {**BASE["dflash_config"], **edit["dflash_config"]}
    with pytest.raises(DraftConfigError) as e:
        DFlashConfig.from_hf(cfg, "d/config.json")
    msg = str(e.value)
    assert e.value.field == field and f"field {field!r}" in msg and needle in msg and "\n" not in msg, msg


def test_bad_config_is_one_stderr_line_from_the_cli(targets, tmp_path, capsys):
    root, hf, _ = targets("gpt_oss")
    make_zlab_draft(hf.config, tmp_path / "d", block_size=BLOCK, target_layer_ids=[1])
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"],
                                                                                    "input_embedding_scale": -2}}))
    assert main(["generate", "--model", str(root), "--draft", str(tmp_path / "d"), "--prompt-ids", "1,2,3",
                 "--max-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("field 'input_embedding_scale' must be a positive finite number, got -2" in line for line in err), err
    assert len([line for line in err if line.startswith("blockspec: error:")]) == 1


def write_data(root, n: int = 6) -> None:
    g = torch.Generator().manual_seed(4)
    seqs = []
    for _ in range(n):
        L = int(torch.randint(14, 30, (1,), generator=g))
        mask = torch.zeros(L, dtype=torch.bool)
        mask[3:] = True
        seqs.append(TokenSequence(torch.randint(0, MASK, (L,), generator=g), mask))
    write_shards(seqs, root)


TRAIN = ["--device", "cpu", "--eval-num-prompts", "0", "--num-anchors", "6", "--batch-anchors", "12",
         "--max-steps", "2", "--lr", "3e-3"]


def assert_zlab_drafts_like_ours(lm, hf, path) -> None:
    """The drafter at `path` loads in the z-lab package (its own from_pretrained) and drafts as ours does."""
    zd = zm.DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32).eval()
    draft = load_draft(SpeculativeConfig(draft_model=str(path)), lm)
    seq = sequence(5)
    steps = steps_over(seq, ENDS[:3])
    block = draft.config.block_size
    assert_same_drafts(our_steps(draft, lm, seq, steps, block), zlab_steps(zd, hf, seq, steps, block))


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "gemma4"])
def test_init_draft_and_train_draft_on_the_family(targets, tmp_path, family):
    root, hf, lm = targets(family)
    init = tmp_path / "init"
    assert main(["init-draft", "--target", str(root), "--out", str(init), "--draft-layers", "2",
                 "--draft-block-size", str(BLOCK), "--sliding-window", "3", "--seed", "1"]) == 0
    cfg = json.loads((init / "config.json").read_text())
    assert cfg["layer_types"] == [SLIDE, FULL] and cfg["sliding_window"] == 3 and cfg["use_sliding_window"] is True
    assert cfg["dflash_config"]["target_layer_ids"] == [2] and cfg["dflash_config"]["mask_token_id"] == VOCAB - 1
    if family == "gemma4":  # its embedding scale and logit cap, as the target applies them
        assert cfg["dflash_config"]["input_embedding_scale"] == 8.0
        assert cfg["dflash_config"]["final_logit_softcapping"] == 2.0
        assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}  # its global layers' theta
    assert_zlab_drafts_like_ours(lm, hf, init)
    data = tmp_path / "data"
    write_data(data)
    tuned = tmp_path / "tuned"
    assert main(["train-draft", "--target", str(root), "--data", str(data), "--out", str(tuned), "--init",
                 str(init), *TRAIN]) == 0
    before = load_draft(SpeculativeConfig(draft_model=str(init)), lm).model.state_dict()
    after = load_draft(SpeculativeConfig(draft_model=str(tuned)), lm).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert_zlab_drafts_like_ours(lm, hf, tuned)
    fresh = tmp_path / "fresh"  # a new drafter tapping a linear / sliding layer and the last, windowed layers
    prompts = tmp_path / "eval.jsonl"  # and the engine's evaluation at the end, speculating on this target
    prompts.write_text('{"prompt_ids": [3, 4, 5]}\n{"prompt_ids": [7, 8]}\n')
    evaluated = [*TRAIN[:2], "--eval-num-prompts", "2", "--eval-prompts", str(prompts), "--eval-max-tokens", "6",
                 *TRAIN[4:]]
    assert main(["train-draft", "--target", str(root), "--data", str(data), "--out", str(fresh), "--draft-layers",
                 "3", "--draft-block-size", "4", "--target-layer-ids", "0,3", "--intermediate-size", "32",
                 "--sliding-window", "4", *evaluated]) == 0
    report = json.loads((fresh / "train_report.json").read_text())
    assert report["steps"] == 2 and report["evals"][0]["generated_tokens"] == 12 and report["tau"] >= 1.0
    assert json.loads((fresh / "config.json").read_text())["layer_types"] == [SLIDE, SLIDE, FULL]
    assert_zlab_drafts_like_ours(lm, hf, fresh)


def test_init_draft_for_a_moe_hybrid_and_a_conditional_generation_checkpoint(tmp_path):
    """An all-expert target (Qwen3.5-MoE: no dense MLP to copy) gets a 3 x hidden draft MLP; a vision-language
    checkpoint's nested text_config gives the vocabulary (the mask token: its last id) and the layers."""
    import hybrid_utils

    hybrid_utils.make_hf(0, moe=True).save_pretrained(str(tmp_path / "moe"))
    assert main(["init-draft", "--target", str(tmp_path / "moe"), "--out", str(tmp_path / "d1"), "--draft-block-size",
                 "4"]) == 0
    assert json.loads((tmp_path / "d1" / "config.json").read_text())["intermediate_size"] == 3 * 64
    hybrid_utils.make_hf(0, conditional=True).save_pretrained(str(tmp_path / "vl"))
    assert main(["init-draft", "--target", str(tmp_path / "vl"), "--out", str(tmp_path / "d2"), "--draft-block-size",
                 "4"]) == 0
    cfg = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == VOCAB - 1 and cfg["num_target_layers"] == 4
    assert main(["init-draft", "--target", str(tmp_path / "vl"), "--out", str(tmp_path / "d3"),
                 "--sliding-window", "0"]) == 2
