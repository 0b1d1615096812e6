"""A tiny target that learned two token cycles and a DFlash drafter trained on its own taps, built in seconds.

Shared by the speculative tests that need acceptance lengths well above 1 (test_spec_trained, test_engine).
`trained_pair()` builds the pair once per test process (the checkpoints go to a private temporary directory and
the loaded models are kept in memory); callers must not modify the returned models."""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from dense_cache import DenseCausalAttention, DenseKVCache
from blockspec.attention.torch_ref import attend
from blockspec.config import SpeculativeConfig
from blockspec.loading.draft_loader import LoadedDraft, load_draft
from blockspec.loading.loader import LoadConfig, LoadedModel, load_model
from dflash_utils import make_zlab_draft
from hf_utils import make_hf_model, save_hf_model

VOCAB = 64
MASK = 63
BLOCK = 8
TAPS = [0, 1]
SEQ_LEN = 80
MAX_POSITIONS = 256
CYCLE_A = list(range(10, 30))  # 10, 11, ..., 29, 10, ...
CYCLE_B = [30 + (3 * i) % 20 for i in range(20)]  # 30, 33, 36, ..., 47, 30+0+..: stride 3 through 30..49
CYCLES = [CYCLE_A, CYCLE_B]


def cycle_seq(cycle: list[int], start: int, length: int) -> list[int]:
    return [cycle[(start + i) % len(cycle)] for i in range(length)]


def batch(gen: torch.Generator, n: int, length: int) -> torch.Tensor:
    rows = []
    for _ in range(n):
        c = CYCLES[int(torch.randint(len(CYCLES), (1,), generator=gen))]
        rows.append(cycle_seq(c, int(torch.randint(len(c), (1,), generator=gen)), length))
    return torch.tensor(rows)


def train_target(hf, steps: int = 150) -> None:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(hf.parameters(), lr=1e-2)
    hf.train()
    for _ in range(steps):
        ids = batch(gen, 8, SEQ_LEN)
        loss = hf(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    hf.eval()


@torch.no_grad()
def target_taps(lm, seq: list[int]) -> torch.Tensor:
    """The target's tapped residual streams [S, len(TAPS)*H] for a whole sequence (one prefill, no grad)."""
    cfg = lm.config
    cache = DenseKVCache.allocate(cfg.num_hidden_layers, len(seq), cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, torch.device("cpu"))
    pos = torch.arange(len(seq))
    return lm.model(torch.tensor(seq), pos, DenseCausalAttention(cache, pos, len(seq)), tap_layers=TAPS).taps


class BlockTrainingAttention:
    """DraftAttentionFn for training many blocks at once: block j (of sequence s_j, anchor a_j) sees the context
    K/V of sequence s_j at positions < a_j and its own block bidirectionally, nothing else."""

    def __init__(self, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        self.ctx_kv, self.mask = ctx_kv, mask

    def __call__(self, layer, q, k, v, scale, causal, window):
        assert not causal and window is None  # full-attention draft layers
        ck, cv = self.ctx_kv[layer]
        return attend(q, torch.cat([ck, k]), torch.cat([cv, v]), self.mask, scale)


def train_draft(lm, draft: LoadedDraft, steps: int = 200, seqs_per_step: int = 8, blocks_per_seq: int = 4) -> list[float]:
    """Minimal DFlash training: block [x_a, MASK x (B-1)] at positions a..a+B-1 over the target's taps of positions
    < a; slot k predicts x_{a+k} through the target's (frozen) lm_head. Returns the loss curve."""
    gen = torch.Generator().manual_seed(1)
    model = draft.model
    lm.model.requires_grad_(False)
    # every cycle from every starting offset (too few distinct sequences and the draft memorizes positions)
    seqs = torch.tensor([cycle_seq(c, o, SEQ_LEN) for c in CYCLES for o in range(len(c))])
    taps = torch.stack([target_taps(lm, s.tolist()) for s in seqs])  # [N, S, k*H], frozen target, no grad
    S, M, nb = SEQ_LEN, seqs_per_step, seqs_per_step * blocks_per_seq
    ctx_pos = torch.arange(S).repeat(M)
    ctx_seq = torch.arange(M).repeat_interleave(S)
    slot = torch.arange(BLOCK)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        chosen = torch.randperm(len(seqs), generator=gen)[:M]
        s = torch.arange(M).repeat_interleave(blocks_per_seq)  # block -> index into chosen
        # anchors: at least one context token, block inside the sequence; half of them early, where the context is
        # too short to hold a whole cycle (the draft must not only learn to copy from one period back)
        a = torch.randint(1, S - BLOCK + 1, (nb,), generator=gen)
        a[::2] = torch.randint(1, 24, (nb // 2,), generator=gen)
        x = seqs[chosen]
        pos = (a[:, None] + slot[None]).flatten()  # [nb*B]
        ids = torch.full((nb, BLOCK), MASK)
        ids[:, 0] = x[s, a]
        labels = x[s[:, None], a[:, None] + slot[None]][:, 1:]  # x_{a+1..a+B-1}
        blk = torch.arange(nb).repeat_interleave(BLOCK)
        q_seq, q_anchor = s.repeat_interleave(BLOCK), a.repeat_interleave(BLOCK)
        sees_ctx = (ctx_seq[None] == q_seq[:, None]) & (ctx_pos[None] < q_anchor[:, None])
        sees_blk = blk[:, None] == blk[None]
        mask = torch.cat([sees_ctx, sees_blk], dim=1)
        with torch.enable_grad():
            attn = BlockTrainingAttention(model.context_kv(taps[chosen].flatten(0, 1), ctx_pos), mask)
            hidden = model(lm.model.embed_tokens(ids.flatten()), pos, attn).view(nb, BLOCK, -1)
            logits = model.compute_logits(hidden[:, 1:].reshape(-1, hidden.shape[-1]), lm.model.lm_head)
            loss = F.cross_entropy(logits, labels.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.detach().item())
    model.eval()
    return losses


@dataclasses.dataclass
class TrainedPair:
    lm: LoadedModel
    draft: LoadedDraft
    losses: list[float]
    fc_changed: bool  # training moved the draft's context projection (gradients reached it)


def build_trained_pair(root: Path) -> TrainedPair:
    """Train the target, save it under root/target, write a random z-lab drafter under root/draft, load both, and
    train the drafter in place."""
    hf = make_hf_model("llama", seed=0, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS)
    train_target(hf)
    save_hf_model(hf, root / "target")
    make_zlab_draft(hf.config, root / "draft", layers=1, block_size=BLOCK, target_layer_ids=TAPS,
                    mask_token_id=MASK, seed=0)
    lm = load_model(str(root / "target"), LoadConfig(device="cpu", with_tokenizer=False))
    draft = load_draft(SpeculativeConfig(draft_model=str(root / "draft")), lm)
    assert draft.spec.num_draft_tokens == BLOCK - 1 and draft.spec.target_layer_ids == TAPS
    fc_before = draft.model.fc.weight.detach().clone()
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only add synchronisation cost
    try:
        losses = train_draft(lm, draft)
    finally:
        torch.set_num_threads(old)
    return TrainedPair(lm, draft, losses, not torch.equal(fc_before, draft.model.fc.weight))


_CACHE: list[TrainedPair] = []


def trained_pair() -> TrainedPair:
    """The pair, trained once per process and shared (read-only) by every test module that asks for it."""
    if not _CACHE:
        root = Path(tempfile.mkdtemp(prefix="blockspec_trained_pair_"))
        atexit.register(shutil.rmtree, root, True)
        _CACHE.append(build_trained_pair(root))
    return _CACHE[0]


def with_k(draft: LoadedDraft, k: int) -> LoadedDraft:
    """The same drafter proposing k tokens per block."""
    return dataclasses.replace(draft, spec=dataclasses.replace(draft.spec, num_draft_tokens=k))
