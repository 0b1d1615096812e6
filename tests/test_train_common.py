"""Shared pieces of the drafter-training tests: tiny targets and synthetic token shards (no tests here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec.data.shards import TokenSequence
from oracles import generate
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from blockspec.sampling import SamplingParams
from blockspec.train.config import TrainConfig
from blockspec.train.dataset import prepare
from blockspec.train.setup import DraftShape, new_draft
from blockspec.train.trainer import train
from hf_utils import make_hf_model, save_hf_model

VOCAB = 64
MASK = 63


def tiny_target(root: Path, layers: int = 3, train_cycles: bool = False, seed: int = 0) -> LoadedModel:
    """A random (or, with train_cycles, cycle-trained: see trained_pair.py) Llama target saved under root."""
    hf = make_hf_model("llama", seed=seed, vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256)
    if train_cycles:
        from trained_pair import train_target

        train_target(hf)
    save_hf_model(hf, root)
    return load_model(str(root), LoadConfig(device="cpu", with_tokenizer=False))


def random_sequences(n: int, gen: torch.Generator, min_len: int = 12, max_len: int = 40) -> list[TokenSequence]:
    """Random ids; loss masks with one or two response segments (a user turn in between), like multi-turn chats."""
    out = []
    for _ in range(n):
        L = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = torch.randint(0, MASK, (L,), generator=gen)
        mask = torch.zeros(L, dtype=torch.bool)
        p = int(torch.randint(1, L // 3 + 1, (1,), generator=gen))
        mask[p:] = True
        if torch.rand((), generator=gen) < 0.5:  # a second user turn inside
            u = int(torch.randint(p, L, (1,), generator=gen))
            mask[u: u + 3] = False
        out.append(TokenSequence(ids, mask))
    return out


def cycle_sequences(lm: LoadedModel, n: int, prompt_len: int = 6, length: int = 64) -> list[TokenSequence]:
    """Prompts from the two cycles of trained_pair.py, responses regenerated greedily by the target (on-policy)."""
    from trained_pair import CYCLES, cycle_seq

    out = []
    for i in range(n):
        prompt = cycle_seq(CYCLES[i % 2], (7 * i) % 20, prompt_len)
        resp = generate(lm, prompt, SamplingParams(max_tokens=length - prompt_len, ignore_eos=True)).token_ids
        ids = torch.tensor(prompt + resp)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[prompt_len:] = True
        out.append(TokenSequence(ids, mask))
    return out


def run_small(lm, data, out, max_steps, resume=False, time_limit_min=None):
    """A few steps of a 2-layer block-4 drafter on `data` into `out` -> (model, checkpoint dict)."""
    cfg = TrainConfig(num_anchors=6, epochs=3, lr=1e-3, batch_anchors=24, grad_accum=2, max_seq_len=36,
                      max_steps=max_steps, save_every=1000, eval_every=0, time_limit_min=time_limit_min)
    setup = new_draft(lm, DraftShape(num_layers=2, block_size=4, target_layer_ids=[0, 2], intermediate_size=32,
                                     mask_token_id=MASK), seed=1, device=torch.device("cpu"))
    train(lm, setup, prepare(data, cfg, "mem"), cfg, Path(out), None, resume=resume, use_tqdm=False)
    return setup.model, torch.load(Path(out) / "checkpoint.pt", weights_only=True)


@pytest.fixture(scope="module")
def cycles(tmp_path_factory):
    """A target that learned two token cycles, and on-policy data: its own greedy continuations."""
    lm = tiny_target(tmp_path_factory.mktemp("cycle_target"), layers=2, train_cycles=True)
    return lm, cycle_sequences(lm, 40)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(its directory, a random tiny target)."""
    root = tmp_path_factory.mktemp("train_target")
    return root, tiny_target(root)
