"""The drafter trainer end to end on CPU: it learns a synthetic task to a real tau, exports a checkpoint the inference
loader reads back exactly, and the `train-draft` CLI runs and rejects bad input (resuming: test_train_resume.py)."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.cli import main
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.data.shards import write_shards
from blockspec.loading.draft_loader import load_draft
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import prepare
from blockspec.train.evaluate import inference_draft
from blockspec.train.export import save_draft
from blockspec.train.setup import DraftShape, draft_from, new_draft
from blockspec.train.trainer import train
from test_train_common import MASK, VOCAB, random_sequences, run_small
from test_train_common import cycles, target  # noqa: F401 - fixtures, used by name

CPU = torch.device("cpu")
SHAPE = DraftShape(num_layers=1, block_size=8, target_layer_ids=[0, 1], intermediate_size=96, mask_token_id=MASK)


def test_learns_the_synthetic_task_to_a_real_tau(cycles, tmp_path):
    lm, seqs = cycles
    cfg = TrainConfig(num_anchors=32, epochs=8, lr=3e-3, warmup_ratio=0.1, batch_anchors=128, max_seq_len=256,
                      eval_every=40, eval_max_tokens=48)
    setup = new_draft(lm, SHAPE, seed=0, device=CPU)
    prompts = [[10, 11, 12, 13, 14], [30, 33, 36, 39]]  # cycle starts not used as training prompts
    report = train(lm, setup, prepare(seqs, cfg, "mem"), cfg, tmp_path, prompts, use_tqdm=False)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert report["steps"] == report["planned_steps"] == 80 and [r["step"] for r in log] == list(range(10, 81, 10))
    assert log[-1]["loss"] < 0.1 * log[0]["loss"], [r["loss"] for r in log]
    assert log[-1]["acc_mean"] > 0.95 and len(log[-1]["acc"]) == 7
    # the acceptance length of the training blocks' hits starts near 1 and ends near the engine's tau below
    assert log[0]["tau"] < 2.0 and 6.0 < log[-1]["tau"] <= 8.0, [r["tau"] for r in log]
    # real speculative decoding with the engine: the drafter proposes whole cycles (block 8 -> at most 8 per step)
    assert [e["step"] for e in report["evals"]] == [40, 80]
    assert report["evals"][0]["tau"] < report["tau"] and report["tau"] > 6.0, report["evals"]
    assert report["tokens_per_s"] > 0 and report["target_tokens"] == 8 * sum(len(s.input_ids) for s in seqs)
    _check_training_replays_the_engine(lm, setup, cfg, prompts)


def test_held_out_sequences_are_scored_and_never_trained_on(cycles, tmp_path):
    lm, seqs = cycles
    cfg = TrainConfig(num_anchors=32, epochs=4, lr=3e-3, warmup_ratio=0.1, batch_anchors=128, max_seq_len=256,
                      eval_every=20, val_fraction=0.25)
    setup = new_draft(lm, SHAPE, seed=0, device=CPU)
    report = train(lm, setup, prepare(seqs, cfg, "mem"), cfg, tmp_path, None, use_tqdm=False)
    held = report["data"]["held_out_sequences"]
    assert held == 10 and report["data"]["sequences"] == 30
    total = sum(len(s.input_ids) for s in seqs)
    assert report["target_tokens"] == 4 * report["data"]["tokens"] and report["data"]["tokens"] < total
    vals = [e["val"] for e in report["evals"]]
    assert [e["step"] for e in report["evals"]] == [20, report["steps"]] and all(v["sequences"] == 10 for v in vals)
    assert vals[-1]["loss"] < vals[0]["loss"] and vals[-1]["tau"] > vals[0]["tau"], vals
    assert 1.0 <= vals[0]["walk_tau"] < vals[-1]["walk_tau"], vals
    assert report["val"] == vals[-1] and report["tau"] is None  # no engine evaluation without prompts
    with pytest.raises(Exception, match="val_fraction=1.0 must be in"):
        TrainConfig(val_fraction=1.0)


def _check_training_replays_the_engine(lm, setup, cfg, prompts) -> None:
    """End-to-end parity: greedy spec decoding of each prompt, then the TRAINING forward over prompt + output with
    every response position as an anchor. Walking the blocks the way verification does (next anchor = anchor +
    acceptance length) must give the engine's acceptance lengths step for step."""
    from blockspec.data.shards import TokenSequence
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    from blockspec.train.anchors import default_gamma, slot_weights
    from blockspec.train.batches import build_micro_batch, generator
    from blockspec.train.dataset import capacity
    from blockspec.train.forward import TrainingForward
    from blockspec.train.anchors import response_starts
    from blockspec.train.walk import walk

    B = setup.model.config.block_size
    llm = LLM.from_loaded(lm, inference_draft(lm, setup.model), engine=EngineConfig(max_num_seqs=1))
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    seqs = [TokenSequence(torch.tensor(p + o.token_ids), torch.tensor([False] * len(p) + [True] * len(o.token_ids)))
            for p, o in zip(prompts, outs)]
    data = prepare(seqs, cfg, "replay")
    cap = capacity(data, cfg, B, pad=False)
    fwd = TrainingForward(lm.model, setup.model, setup.tap_layers, cap, "sdpa", compiled=False)
    varied = set()
    for i, (seq, out) in enumerate(zip(data.seqs, outs)):
        mb = build_micro_batch([seq], cap, 10_000, setup.mask_token_id, slot_weights(B, default_gamma(B)),
                               generator(0, i))
        with torch.no_grad():
            r = fwd(mb)
        hits = torch.zeros(len(mb.block_ids))
        hits[mb.loss_rows] = r.hits.float()
        accepted = hits.view(-1, B)[:, 1:].cumprod(1).sum(1).long().tolist()
        assert accepted == r.block_accepted.long().tolist()
        assert response_starts(seq.loss_mask) == [len(prompts[i])]
        steps = [accepted[j] + 1 for j in walk(mb.block_pos[::B].tolist(), accepted, [len(prompts[i])])]
        n = len(steps) - 1  # the engine's last steps are cut by max_tokens, the walk's by the block rule
        assert n >= 3 and steps[:n] == out.acceptance_lengths[:n], (steps, out.acceptance_lengths)
        varied.update(steps[:n])
    assert len(varied) >= 2  # not a trivial all-accepted or all-rejected replay


def test_export_round_trips_through_the_inference_loader(target, tmp_path):
    root, lm = target
    data = random_sequences(8, torch.Generator().manual_seed(4))
    model, _ = run_small(lm, data, tmp_path, max_steps=2)
    loaded = load_draft(SpeculativeConfig(draft_model=str(tmp_path)), lm)
    assert loaded.spec.target_layer_ids == [0, 2] and loaded.spec.mask_token_id == MASK
    assert loaded.spec.block_size == 4 and loaded.config.num_hidden_layers == 2
    exported = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}  # written in bf16
    for name, p in loaded.model.state_dict().items():
        assert torch.equal(p, exported[name]), name
    ids = torch.tensor([5, 9, MASK, MASK])
    ctx_taps = torch.randn(10, 128)
    logits = [_block_logits(lm, m, ids, ctx_taps)
              for m in (loaded.model, inference_draft(lm, model.to(torch.bfloat16).float()).model)]
    assert torch.equal(logits[0], logits[1])
    # and --init continues from it with exactly those weights, as fp32 master weights
    again = draft_from(lm, str(tmp_path), CPU)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in again.model.parameters())
    assert all(torch.equal(p, exported[n]) for n, p in again.model.state_dict().items())
    assert again.config == json.loads((tmp_path / "config.json").read_text())


def _block_logits(lm, m, ids: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """Draft logits of the block `ids` placed right after a context of len(taps) positions with these taps."""
    from dense_cache import DenseDraftAttention, DenseKVCache

    n = len(taps)
    pos = torch.arange(n, n + len(ids))
    cache = DenseKVCache.allocate(m.config.num_hidden_layers, n, m.config.num_key_value_heads, m.config.head_dim,
                                  torch.float32, CPU)
    with torch.no_grad():
        for layer, (k, v) in enumerate(m.context_kv(taps, torch.arange(n))):
            cache.k[layer], cache.v[layer] = k, v
        return m.compute_logits(m(lm.model.embed_tokens(ids), pos, DenseDraftAttention(cache, n, pos)),
                                lm.model.lm_head)


def _cli_data(tmp_path, n=10):
    data = tmp_path / "data"
    write_shards(random_sequences(n, torch.Generator().manual_seed(6)), data)
    return data


def test_cli_end_to_end(target, tmp_path, capsys):
    root, lm = target
    data, out = _cli_data(tmp_path), tmp_path / "out"
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"prompt_ids": [3, 4, 5]}\n{"prompt_ids": [7, 8]}\n{"prompt_ids": [9]}\n')
    args = ["train-draft", "--target", str(root), "--data", str(data), "--out", str(out), "--draft-layers", "1",
            "--draft-block-size", "4", "--intermediate-size", "32", "--num-anchors", "8", "--batch-anchors", "16",
            "--eval-prompts", str(prompts), "--eval-num-prompts", "2", "--eval-max-tokens", "6", "--device", "cpu",
            "--walk-weight", "0.5", "--prefix-weight", "0.5", "--opening-weight", "1", "--opening-tokens", "4",
            "--epochs", "3", "--max-steps", "3"]
    assert main(args) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 3 and report["planned_steps"] > 3 and len(report["evals"]) == 1
    assert report["config"]["walk_weight"] == 0.5 and report["config"]["prefix_weight"] == 0.5
    assert report["config"]["opening_weight"] == 1.0 and report["config"]["opening_tokens"] == 4
    assert report["evals"][0]["generated_tokens"] == 12 and report["attention"] == "sdpa"
    assert "trained 3 steps" in capsys.readouterr().err
    draft = load_draft(SpeculativeConfig(draft_model=str(out)), lm)
    assert draft.spec.target_layer_ids == [1] and draft.spec.mask_token_id == VOCAB - 1  # defaults for 3 layers
    assert main(args[:-2] + ["--max-steps", "5", "--resume"]) == 0  # continues on the same schedule
    assert json.loads((out / "train_report.json").read_text())["steps"] == 5


def test_init_grows_the_drafter_by_identity_layers(target, tmp_path, capsys):
    # --init --draft-layers N appends layers whose residual branches end in zeros: the grown drafter gives the
    # same logits as the one it grew from, and one training step moves the zeros; it cannot shrink
    root, lm = target
    small = tmp_path / "small"
    setup = new_draft(lm, DraftShape(num_layers=1, block_size=4, intermediate_size=32), 3, CPU)
    save_draft(setup.model, setup.config, small, dtype=torch.float32)
    grown = draft_from(lm, str(small), CPU, num_layers=3, seed=1)
    assert grown.config["num_hidden_layers"] == 3 and grown.config["layer_types"] == ["full_attention"] * 3
    for layer in grown.model.layers[1:]:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert all(w.abs().sum() > 0 for w in layer.self_attn.qkv_proj.weight.split(layer.self_attn.qkv_proj.sizes))
    ids, taps = torch.tensor([5, MASK, MASK, MASK]), torch.randn(6, setup.model.fc.in_features)
    assert torch.equal(_block_logits(lm, setup.model, ids, taps), _block_logits(lm, grown.model, ids, taps))
    nested = tmp_path / "nested"  # a config that also keeps the layer count inside dflash_config, where it wins
    nested.mkdir()
    cfg = json.loads((small / "config.json").read_text())
    cfg["dflash_config"]["num_hidden_layers"] = 1
    (nested / "config.json").write_text(json.dumps(cfg))
    (nested / "model.safetensors").write_bytes((small / "model.safetensors").read_bytes())
    assert draft_from(lm, str(nested), CPU, num_layers=2).model.config.num_hidden_layers == 2
    out = tmp_path / "out"
    args = ["train-draft", "--target", str(root), "--data", str(_cli_data(tmp_path)), "--out", str(out), "--device",
            "cpu", "--eval-num-prompts", "0", "--num-anchors", "8", "--batch-anchors", "16", "--max-steps", "1",
            "--init", str(small), "--draft-layers", "2"]
    assert main(args) == 0
    trained = load_draft(SpeculativeConfig(draft_model=str(out)), lm)
    assert trained.config.num_hidden_layers == 2 and trained.model.layers[1].self_attn.o_proj.weight.any()
    resumed = list(args) + ["--resume"]  # the grown drafter resumes like any other
    resumed[resumed.index("--max-steps") + 1] = "2"
    assert main(resumed) == 0 and json.loads((out / "train_report.json").read_text())["steps"] == 2
    assert main(args[:-1] + ["0"]) == 2
    assert "--draft-layers=0 is below the 1 layers of" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--num-anchors", "64", "--batch-anchors", "32"],
     "batch_anchors=32 is smaller than num_anchors=64: one sequence's blocks would not fit in a micro-batch"),
    (["--init", "x", "--draft-block-size", "4"],
     "--draft-block-size cannot be combined with --init (the drafter's shape comes from x/config.json; only "
     "--draft-layers may add layers)"),
    (["--target-layer-ids", "0,7"], "train-draft: target_layer_ids=[0, 7] contains 7, but the target has only 3 "
                                    "layers (ids are 0-based)"),
    (["--target-layer-ids", "1,1"], "train-draft: target_layer_ids=[1, 1] must be distinct non-negative layer indices"),
    (["--target-layer-ids", "2,-1"], "train-draft: target_layer_ids=[2, -1] must be distinct non-negative layer "
                                     "indices"),
    (["--draft-block-size", "1"], "--draft-block-size=1 must be >= 2 (slot 0 holds the given token)"),
    (["--lr", "0"], "lr=0.0 must be > 0"),
    (["--walk-weight", "-1"], "walk_weight=-1.0 must be >= 0"),
    (["--prefix-weight", "1.5"], "prefix_weight=1.5 must be in [0, 1]"),
    (["--opening-weight", "-0.5"], "opening_weight=-0.5 must be >= 0"),
    (["--opening-tokens", "0"], "opening_tokens=0 must be an integer >= 1"),
    (["--resume"], "checkpoint.pt does not exist"),
    (["--max-seq-len", "4", "--draft-block-size", "8"], "no usable training sequence: each needs two consecutive "
                                                         "response (loss_mask) tokens within --max-seq-len 4"),
])
def test_cli_rejects_bad_input(target, tmp_path, capsys, extra, message):
    root, _ = target
    args = ["train-draft", "--target", str(root), "--data", str(_cli_data(tmp_path, 3)), "--out",
            str(tmp_path / "o"), "--device", "cpu", "--eval-num-prompts", "0", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and message in err, err


def test_cli_trains_on_several_data_directories(target, tmp_path, capsys):
    root, _ = target
    a, b = random_sequences(3, torch.Generator().manual_seed(1)), random_sequences(4, torch.Generator().manual_seed(2))
    write_shards(a, tmp_path / "a")
    write_shards(b, tmp_path / "b")
    assert main(["train-draft", "--target", str(root), "--data", str(tmp_path / "a"), str(tmp_path / "b"), "--out",
                 str(tmp_path / "o"), "--device", "cpu", "--eval-num-prompts", "0", "--draft-layers", "1",
                 "--draft-block-size", "4", "--max-steps", "1"]) == 0
    data = json.loads((tmp_path / "o" / "train_report.json").read_text())["data"]
    assert data["sequences"] == 7 and data["tokens"] == sum(len(s.input_ids) for s in a + b)
    # resuming on other data would continue a plan made for different sequences
    assert main(["train-draft", "--target", str(root), "--data", str(tmp_path / "a"), "--out", str(tmp_path / "o"),
                 "--device", "cpu", "--eval-num-prompts", "0", "--draft-layers", "1", "--draft-block-size", "4",
                 "--max-steps", "2", "--resume"]) == 2
    assert "cannot resume on other data: the checkpoint trained on 7 sequences" in capsys.readouterr().err


def test_cli_rejects_data_of_another_vocabulary(target, tmp_path, capsys):
    root, _ = target
    seq = random_sequences(1, torch.Generator().manual_seed(0))[0]
    seq.input_ids[3] = 200
    write_shards([seq], tmp_path / "data")
    write_shards(random_sequences(2, torch.Generator().manual_seed(1)), tmp_path / "good")
    assert main(["train-draft", "--target", str(root), "--data", str(tmp_path / "good"), str(tmp_path / "data"),
                 "--out", str(tmp_path / "o"), "--device", "cpu", "--eval-num-prompts", "0"]) == 2
    assert capsys.readouterr().err == (f"blockspec: error: {tmp_path / 'data'}: token id 200 is outside the target's "
                                       f"vocabulary [0, {VOCAB}): the data was made for another target\n")
