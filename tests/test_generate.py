"""Greedy generation: our CLI equals transformers' greedy generate on checkpoints saved by save_pretrained."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from blockspec.cli import main
from oracles import generate
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.sampling import SamplingParams
from hf_utils import make_hf_model, save_hf_model


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cli_greedy_equals_transformers(tmp_path, capsys, arch):
    hf = make_hf_model(arch, seed=3)
    hf.generation_config.eos_token_id = None
    d = save_hf_model(hf, tmp_path)
    prompt = [5, 17, 99, 3, 42, 8]
    ref = hf_greedy(hf, prompt, 24)
    # eos_token_id=2 in config.json: make the test independent of when it appears by cutting the reference there
    if 2 in ref:
        ref = ref[: ref.index(2) + 1]
    rc = main(["generate", "--model", str(d), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "24",
               "--json", "--device", "cpu"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert out["token_ids"] == ref
    assert out["num_prompt_tokens"] == len(prompt) and out["num_generated_tokens"] == len(ref)
    assert out["finish_reason"] == ("stop" if ref[-1] == 2 else "length")
    assert out["text"] is None and out["time_s"] > 0


def test_sharded_checkpoint_and_subprocess_cli(tmp_path):
    hf = make_hf_model("llama", seed=4)
    hf.save_pretrained(str(tmp_path), max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    lm = load_model(str(tmp_path), LoadConfig(device="cpu", with_tokenizer=False))
    ours = generate(lm, [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True)).token_ids
    assert ours == hf_greedy(hf, [1, 2, 3], 10)
    p = subprocess.run([sys.executable, "-m", "blockspec", "generate", "--model", str(tmp_path), "--prompt-ids",
                        "1,2,3", "--max-tokens", "10", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"text", "token_ids", "num_prompt_tokens", "num_generated_tokens", "finish_reason",
                        "time_s", "tokens_per_second"}
    stop_cut = ours[: ours.index(2) + 1] if 2 in ours else ours
    assert out["token_ids"] == stop_cut


def test_max_tokens_and_stop(tmp_path):
    hf = make_hf_model("qwen3", seed=5)
    lm = load_model(str(save_hf_model(hf, tmp_path)), LoadConfig(device="cpu", with_tokenizer=False))
    free = generate(lm, [7, 7, 7], SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    stop = free[4]
    r = generate(lm, [7, 7, 7], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))
    assert r.token_ids == free[: free.index(stop) + 1] and r.finish_reason == "stop"
    r = generate(lm, [7, 7, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert r.token_ids == free[:3] and r.finish_reason == "length"
