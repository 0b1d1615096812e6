"""Drafter training on torch.distributed, on the CPU over gloo with two ranks (`torchrun` in a subprocess): the loss
curve, the weights and the export equal one process's with the same global batch; a two-rank checkpoint resumes in one
process; --fsdp equals plain data parallelism; bad launches end with one line on every rank instead of hanging.

The data (37 sequences) plans 9 micro-batches per epoch and --grad-accum 4 makes steps of 4, 4 and 1: two micro-batches
per rank per step, and at each epoch's end a step in which rank 1 has none (zero gradients; under --fsdp a target pass
of its own only to join the layers' all-gathers). The held-out set is one micro-batch, so validation has an idle rank
too."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from blockspec.cli import main
from blockspec.data.shards import write_shards
from launch_utils import free_port, rank_env, ranks_by_hand, torchrun, torchrun_two_hosts
from test_train_common import MASK, random_sequences, tiny_target

TOL = 1e-5
TRAIN = ["train-draft", "--draft-layers", "2", "--draft-block-size", "4", "--intermediate-size", "32",
         "--target-layer-ids", "0,2", "--mask-token-id", str(MASK), "--num-anchors", "6", "--batch-anchors", "24",
         "--max-seq-len", "36", "--epochs", "3", "--lr", "1e-3", "--grad-accum", "4", "--log-every", "1",
         "--val-fraction", "0.1", "--eval-num-prompts", "0", "--seed", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(command line without --out and --max-steps, tmp dir): a tiny target and 37 random sequences on disk."""
    tmp = tmp_path_factory.mktemp("distributed")
    tiny_target(tmp / "target")
    write_shards(random_sequences(37, torch.Generator().manual_seed(3)), tmp / "data")
    return TRAIN + ["--target", str(tmp / "target"), "--data", str(tmp / "data")], tmp


@pytest.fixture(scope="module")
def runs(files):
    """Output directories: one process to 5 and to 8 steps (in this process), two ranks to 5 steps."""
    args, tmp = files
    for steps in (5, 8):
        assert main(args + ["--out", str(tmp / f"one{steps}"), "--max-steps", str(steps)]) == 0
    t0 = time.monotonic()
    status, output = torchrun(args + ["--out", str(tmp / "two5"), "--max-steps", "5"])
    assert status == 0, output[-3000:]
    print(f"two-rank torchrun: {time.monotonic() - t0:.1f} s")
    return {name: tmp / name for name in ("one5", "one8", "two5")}


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def assert_same_curve(a: list[dict], b: list[dict]) -> float:
    """Step by step: the same steps and learning rates; loss, per-slot accuracy and tau within TOL. -> max loss gap."""
    assert [e["step"] for e in a] == [e["step"] for e in b]
    gap = 0.0
    for x, y in zip(a, b):
        assert x["lr"] == pytest.approx(y["lr"], abs=1e-12)
        gap = max(gap, abs(x["loss"] - y["loss"]))
        assert x["loss"] == pytest.approx(y["loss"], abs=TOL), x["step"]
        assert x["acc"] == pytest.approx(y["acc"], abs=TOL) and x["tau"] == pytest.approx(y["tau"], abs=TOL)
    return gap


def assert_same_drafter(a: Path, b: Path) -> tuple[float, float]:
    """The fp32 weights (checkpoint) within TOL, and the bf16 exports within TOL, or one bf16 rounding step where
    weights that close lie on either side of a rounding boundary. -> (max fp32 gap, max export gap)."""
    wa, wb = (torch.load(d / "checkpoint.pt", weights_only=True)["model"] for d in (a, b))
    assert wa.keys() == wb.keys()
    fp32 = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert fp32 <= TOL
    ea, eb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ea.keys() == eb.keys()
    for k in ea:
        torch.testing.assert_close(ea[k].float(), eb[k].float(), atol=TOL, rtol=0, msg=k)
    return fp32, max((ea[k].float() - eb[k].float()).abs().max().item() for k in ea)


def progress(out: Path) -> dict:
    p = torch.load(out / "checkpoint.pt", weights_only=True)["progress"]
    return {k: p[k] for k in ("step", "epoch", "micro", "tokens", "blocks")}


def test_two_ranks_train_as_one_process_with_the_same_global_batch(runs):
    one, two = runs["one5"], runs["two5"]
    gap = assert_same_curve(log(two), log(one))  # rank 0 alone writes the log: 5 lines, not 10
    fp32, export = assert_same_drafter(two, one)
    print(f"two ranks vs one process: loss {gap:.1e}, fp32 weights {fp32:.1e}, export {export:.1e}")
    assert progress(two) == progress(one) == {**progress(one), "step": 5, "epoch": 1, "micro": 8}
    r1, r2 = (json.loads((d / "train_report.json").read_text()) for d in (one, two))
    assert r2["ranks"]["world_size"] == 2 and not r2["ranks"]["fsdp"] and r1["ranks"]["world_size"] == 1
    assert r2["target_tokens"] == r1["target_tokens"] and r2["anchor_blocks"] == r1["anchor_blocks"]
    v1, v2 = r1["val"], r2["val"]  # the held-out micro-batch scored on rank 0, rank 1 idle
    assert v2["sequences"] == v1["sequences"] == 4
    assert v2["loss"] == pytest.approx(v1["loss"], abs=TOL) and v2["acc"] == pytest.approx(v1["acc"], abs=TOL)


def test_a_two_rank_checkpoint_resumes_in_one_process(runs, files, tmp_path):
    """Global step and data position are the whole state: one process continues the two ranks' run (through the
    epoch's one-micro-batch step) as one process that ran from the start."""
    args, _ = files
    shutil.copytree(runs["two5"], tmp_path / "out")
    assert main(args + ["--out", str(tmp_path / "out"), "--max-steps", "8", "--resume"]) == 0
    straight = runs["one8"]
    assert_same_curve(log(tmp_path / "out"), log(straight))  # steps 1-5 from the two ranks, 6-8 resumed
    fp32, export = assert_same_drafter(tmp_path / "out", straight)
    print(f"resumed vs straight: fp32 weights {fp32:.1e}, export {export:.1e}")
    assert progress(tmp_path / "out") == progress(straight) == {**progress(straight), "step": 8, "epoch": 2}


def test_fsdp_launched_as_two_hosts_equals_plain_data_parallel(runs, files, tmp_path):
    """--fsdp, launched with torchrun's multi-host flags: the same run as the single-host one without FSDP."""
    args, _ = files
    for status, output in torchrun_two_hosts(args + ["--out", str(tmp_path / "fsdp"), "--max-steps", "5", "--fsdp"]):
        assert status == 0, output[-3000:]
    plain = runs["two5"]
    gap = assert_same_curve(log(tmp_path / "fsdp"), log(plain))
    fp32, export = assert_same_drafter(tmp_path / "fsdp", plain)
    print(f"fsdp vs plain data parallel: loss {gap:.1e}, fp32 weights {fp32:.1e}, export {export:.1e}")
    r_fsdp, r_plain = (json.loads((d / "train_report.json").read_text())["ranks"] for d in (tmp_path / "fsdp", plain))
    assert r_fsdp["fsdp"] and r_fsdp["world_size"] == 2
    # rank 0 holds half of each decoder layer and the whole embedding, norm and lm_head (64 x 64 each, fp32)
    whole = r_plain["target_weight_bytes"]
    outside_layers = (2 * 64 * 64 + 64) * 4
    assert r_fsdp["target_weight_bytes"] == outside_layers + (whole - outside_layers) // 2


@pytest.mark.parametrize("extra, port, message", [
    (["--grad-accum", "3"], True, "--grad-accum 3 (micro-batches per optimizer step over all ranks, default 1: the "
                                  "global batch) is not a multiple of the world size 2, so the ranks cannot share it "
                                  "equally; use 2 or 4"),
    ([], False, "distributed launch: MASTER_ADDR, MASTER_PORT not set in the environment (torchrun sets RANK, "
                "WORLD_SIZE, MASTER_ADDR, MASTER_PORT: `torchrun --nproc-per-node N -m blockspec ...`)"),
])
def test_a_bad_launch_ends_each_rank_with_one_line_before_any_rendezvous(files, tmp_path, capfd, monkeypatch, extra,
                                                                         port, message):
    """What every rank can tell from its own flags and environment it says at once, the same line on each rank."""
    args, _ = files
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for rank in (0, 1):
        for k, v in rank_env(rank, free_port() if port else None).items():
            monkeypatch.setenv(k, v)
        assert main(args + ["--out", str(tmp_path / "out"), "--max-steps", "1"] + extra) == 2
        assert capfd.readouterr().err == f"blockspec: error: {message}\n"


def test_fsdp_outside_a_launch_is_one_line(files, tmp_path, capfd):
    args, _ = files
    assert main(args + ["--out", str(tmp_path / "out"), "--fsdp"]) == 2
    assert capfd.readouterr().err == ("blockspec: error: --fsdp shards the target over the ranks of a distributed "
                                      "launch, and this process is not one: `torchrun --nproc-per-node N -m blockspec "
                                      "train-draft --fsdp ...`\n")


@pytest.mark.parametrize("rank, message", [
    (0, r"rank 0: distributed set-up did not complete within 2 s at 127\.0\.0\.1:\d+ \(Timed out after \d+ seconds "
        r"waiting for clients\. 1/2 clients joined\.\): are all 2 ranks started\? \(--dist-timeout SECONDS\)"),
    (1, r"rank 1: no rendezvous store answered at 127\.0\.0\.1:\d+ within the set-up timeout: is rank 0 started, and "
        r"MASTER_ADDR/MASTER_PORT right\? \(--dist-timeout SECONDS\)"),
])
def test_a_rank_whose_peers_never_come_gives_up_after_the_set_up_timeout(files, tmp_path, capfd, monkeypatch, rank,
                                                                         message):
    """One rank of two started alone: set-up ends after --dist-timeout with one line (and none of torch's own
    connection-retry logging), instead of waiting for its peer forever."""
    args, _ = files
    for k, v in rank_env(rank, free_port()).items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    assert main(args + ["--out", str(tmp_path / "out"), "--grad-accum", "2", "--dist-timeout", "2"]) == 2
    assert time.monotonic() - t0 < 15
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("blockspec: error: "), err
    assert re.fullmatch(message, err.removeprefix("blockspec: error: ").rstrip("\n")), err


def test_mismatched_data_across_ranks_ends_every_rank_with_one_line(files, tmp_path):
    """Ranks that read different data would plan different steps and wait for each other forever; ranks of which one
    cannot read its data would wait for the one that is gone. Both end on every rank with the same one line."""
    args, tmp = files
    write_shards(random_sequences(37, torch.Generator().manual_seed(4)), tmp_path / "other")  # same count, other ids
    base = args + ["--out", str(tmp_path / "out"), "--max-steps", "1"]
    other = [a if a != str(tmp / "data") else str(tmp_path / "other") for a in base]
    missing = [a if a != str(tmp / "data") else str(tmp_path / "missing") for a in base]
    lines = [r"blockspec: error: rank 1's training data differs from rank 0's \(sha256: '[0-9a-f]+' vs '[0-9a-f]+', "
             r"tokens: \d+ vs \d+\): --data must name the same data on every rank \(on a filesystem every host sees, "
             r"or identical copies\)",
             rf"blockspec: error: rank 1: {tmp_path}/missing/manifest.json: not found: {tmp_path}/missing is not a "
             rf"blockspec training-data directory"]
    for ranks, line in zip(ranks_by_hand([[base, other], [base, missing]]), lines):
        for status, err in ranks:
            assert status == 2 and err.count("\n") == 1 and re.fullmatch(line, err.rstrip("\n")), err  # stdout too
