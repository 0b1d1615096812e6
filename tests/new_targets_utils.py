"""Tiny gpt-oss and Gemma 4 targets for the engine tests (tests/test_new_targets_engine.py), trained on
tests/trained_pair.py's token cycles so that drafts get accepted, with a DFlash drafter trained on their taps: built
once per process and family, in seconds (callers must not modify the models).

- gpt-oss: transformers' GptOssForCausalLM (tests/test_gpt_oss.py's builder): learned sinks, full / sliding / sliding /
  full layers with a window of 3 (far shorter than the prompts), q/k/v/o biases off, routed experts (8, 3 a token)
  with the clamped SwiGLU, YaRN rotary.
- Gemma 4: transformers' Gemma4ForCausalLM (tests/test_gemma4.py's builder): sliding / global layers (window 5, the
  global ones with their own head size), the last two layers sharing K/V, per-layer inputs, soft-capped logits, routed
  experts beside the dense MLP.

`hf_greedy` is the plain-decoding oracle: transformers' full forward over the whole sequence for every new token (no
cache, nothing shared with blockspec's code), argmax."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

import test_gemma4
import test_gpt_oss
import trained_pair as tp
from blockspec.config import SpeculativeConfig
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from dflash_utils import make_zlab_draft
from drafter_targets import our_taps

CPU = LoadConfig(device="cpu", with_tokenizer=False)
SLIDE, FULL = "sliding_attention", "full_attention"
CAP = 4.0  # Gemma 4's logit soft-cap: it bites (trained logits reach well past it), yet leaves the argmax learnable

FAMILIES: dict[str, Callable[[], Any]] = {
    "gpt_oss": lambda: test_gpt_oss.make_hf(
        1, vocab_size=tp.VOCAB, **test_gpt_oss.CONFIGS["own-pattern"][1]),
    "gemma4": lambda: test_gemma4.make_hf(
        0, vocab_size=tp.VOCAB, vocab_size_per_layer_input=tp.VOCAB, max_position_embeddings=tp.MAX_POSITIONS,
        hidden_size_per_layer_input=8, num_kv_shared_layers=2, final_logit_softcapping=CAP,
        layer_types=[SLIDE, FULL, SLIDE, FULL], enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32),
}


@dataclass
class Pair:
    root: Path  # target/ and draft/ under it
    hf: Any  # transformers' model, trained (eval mode)
    lm: LoadedModel  # blockspec's load of target/
    draft: LoadedDraft  # a DFlash drafter (taps of layers 0 and 1, block 8) trained on lm's taps


_PAIRS: dict[str, Pair] = {}


def trained_pair(family: str) -> Pair:
    """The family's target trained on the cycles (tp.train_target: transformers' own training forward) and saved as
    a safetensors directory, loaded by blockspec; a random z-lab drafter for it trained in place on OUR target's
    taps (the drafter trainer's target pass, train/target_pass.py: windows, sinks and shared K/V honoured)."""
    if family in _PAIRS:
        return _PAIRS[family]
    root = Path(tempfile.mkdtemp(prefix=f"blockspec_{family}_pair_"))
    atexit.register(shutil.rmtree, root, True)
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only add synchronisation cost
    try:
        hf = FAMILIES[family]()
        tp.train_target(hf)
        hf.save_pretrained(str(root / "target"))
        make_zlab_draft(hf.config, root / "draft", layers=1, block_size=tp.BLOCK, target_layer_ids=tp.TAPS,
                        mask_token_id=tp.MASK, seed=0)
        lm = load_model(str(root / "target"), CPU)
        draft = load_draft(SpeculativeConfig(draft_model=str(root / "draft")), lm)
        # tp.train_draft reads the taps through a dense cache of the config's shape: ours go through the trainer's
        taps = lambda lm_, seq: our_taps(lm_, torch.tensor(seq), tp.TAPS)  # noqa: E731
        with mock.patch.object(tp, "target_taps", taps):
            tp.train_draft(lm, draft)
    finally:
        torch.set_num_threads(old)
    _PAIRS[family] = Pair(root, hf, lm, draft)
    return _PAIRS[family]


_greedy_memo: dict = {}


@torch.no_grad()
def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` by transformers' full forward over the whole sequence each time (memoized)."""
    key = (id(hf), tuple(prompt), n)
    if key not in _greedy_memo:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        _greedy_memo[key] = seq[len(prompt):]
    return _greedy_memo[key]
