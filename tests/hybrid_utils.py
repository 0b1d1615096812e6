"""Tiny random Qwen3.5 / Qwen3.5-MoE checkpoints made with transformers (the reference), and a runner that drives our
hybrid model over a paged KV pool and a RecurrentState the way the engine does: sequences with slots, varlen prefill
chunks, batched decode rows, verify blocks (their rows' inputs kept) and the replay commit after them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from blockspec.attention.paged_ref import PagedBatch, PagedTargetAttention
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.models.base import ForwardOutput
from blockspec.models.hybrid_state import RecurrentBatch, RecurrentState

VOCAB = 128

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
              num_position_embeddings=16, patch_size=4)


def hf_config(moe: bool = False, conditional: bool = False, **overrides: Any):
    import transformers as tf

    text = {**TEXT, **(MOE if moe else {}), **overrides}
    if moe:
        text.pop("intermediate_size")
    if conditional:
        cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
        return cls(text_config=text, vision_config=VISION, tie_word_embeddings=text["tie_word_embeddings"])
    return (tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig)(**text)


def make_hf(seed: int = 0, moe: bool = False, conditional: bool = False, **overrides: Any):
    """A random tiny Qwen3.5 (-MoE) model in fp32, eval mode. HF's init leaves the (1 + w) norms at w = 0, the gated
    norm at 1 and dt_bias at 1: perturbed so the tests see them; the router scaled up (clear routing margins) and the
    experts too, so that they move the logits."""
    import transformers as tf

    cfg = hf_config(moe, conditional, **overrides)
    torch.manual_seed(seed)
    if conditional:
        cls = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
    else:
        cls = tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif ".mlp.experts." in name or "shared_expert" in name:
                p.copy_(torch.randn_like(p) * 0.15)
            elif name.endswith(("norm.weight", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@dataclass
class PagedRunner:
    """Our loaded hybrid model (lm.model) with its own pool and state: sequence i owns state slot i and a contiguous
    run of pool blocks; `lens[i]` tokens of it are committed."""

    model: Any
    num_seqs: int
    max_len: int
    keep_seqs: int = 0
    keep_rows: int = 0
    block_size: int = 16
    lens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg, m = self.model.config, self.model
        dtype = m.embed_tokens.weight.dtype
        per_seq = math.ceil(self.max_len / self.block_size)
        shape = CacheShape(m.num_kv_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.pool = KVPool(self.num_seqs * per_seq, self.block_size, shape, None, dtype, torch.device("cpu"))
        self.state = RecurrentState(m.recurrent_shape(), self.num_seqs, dtype, "cpu", self.keep_seqs, self.keep_rows)
        self.tables = torch.arange(self.num_seqs * per_seq).view(self.num_seqs, per_seq)
        self.lens = [0] * self.num_seqs

    def forward(self, runs: Sequence[tuple[int, Sequence[int]]], keep: Sequence[bool] = (), taps: Sequence[int] = ()
                ) -> tuple[ForwardOutput, RecurrentBatch]:
        """One forward over `runs` = (sequence, its next tokens) each, continuing at lens[sequence]. A run with keep
        set is a verify block: its lens are not advanced (the caller commits and advances)."""
        keep = list(keep) or [False] * len(runs)
        ids, pos, slots, starts = [], [], [], [0]
        for s, toks in runs:
            ids += list(toks)
            for p in range(self.lens[s], self.lens[s] + len(toks)):
                pos.append(p)
                slots.append(int(self.tables[s, p // self.block_size]) * self.block_size + p % self.block_size)
            starts.append(starts[-1] + len(toks))
        seqs = torch.tensor([s for s, _ in runs])
        positions, slot_mapping = torch.tensor(pos), torch.tensor(slots)
        query_start = torch.tensor(starts, dtype=torch.int32)
        kv_lens = torch.tensor([self.lens[s] + len(t) for s, t in runs], dtype=torch.int32)
        batch = PagedBatch(positions, slot_mapping, query_start, kv_lens, self.tables[seqs],
                           max(len(t) for _, t in runs))
        rb = RecurrentBatch.build(self.state, seqs, query_start, positions, keep)
        with torch.no_grad():
            out = self.model(torch.tensor(ids), positions, PagedTargetAttention(self.pool, batch), tap_layers=taps,
                             state=rb)
        for (s, toks), k in zip(runs, keep):
            if not k:
                self.lens[s] += len(toks)
        return out, rb

    def commit(self, rb: RecurrentBatch, accepted: Sequence[int]) -> None:
        """After a forward with verify blocks: each one's slot <- its state after accepted[i] drafts (per run)."""
        with torch.no_grad():
            self.model.commit_state(rb, torch.tensor(accepted))

    def slot_state(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [L, C, K-1], delta-rule states [L, H, Dk, Dv]) of sequence s, every linear layer, copies."""
        return self.state.conv[:, s].clone(), self.state.ssm[:, s].clone()


# (prompt length, rows in the first forward, rows in the second): sequence 0 is prefilled in two chunks (the second
# continuing a chunked state and mixed with the others' first decode rows), sequence 1 from a one-row prefill,
# sequence 2 from a prefill longer than RECURRENT_MAX_ROWS; every prompt is then decoded one row a step, batched
PLAN = [(150, 100, 40), (9, 1, 1), (40, 30, 1)]


def prefill_decode(model, prompts: Sequence[torch.Tensor], taps: Sequence[int] = ()
                   ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Our (logits, taps) over every row of each prompt, run through PLAN (batched prefill chunks, then decode)."""
    runner = PagedRunner(model, len(prompts), max(len(p) for p in prompts))
    got: list[list[ForwardOutput]] = [[] for _ in prompts]
    done = [0] * len(prompts)

    def step(sizes: Sequence[int]) -> None:
        sizes = [min(n, len(p) - d) for n, p, d in zip(sizes, prompts, done)]  # a short prompt: fewer rows
        runs = [(i, prompts[i][done[i]:done[i] + n].tolist()) for i, n in enumerate(sizes) if n > 0]
        if not runs:
            return
        out, _ = runner.forward(runs, taps=taps)
        lo = 0
        for i, toks in runs:
            rows = slice(lo, lo + len(toks))
            got[i].append(ForwardOutput(out.logits[rows], out.taps[rows] if taps else None, out.hidden[rows]))
            done[i] += len(toks)
            lo += len(toks)

    step([first for _, first, _ in PLAN[:len(prompts)]])
    step([second for _, _, second in PLAN[:len(prompts)]])
    while any(d < len(p) for d, p in zip(done, prompts)):
        step([1 if d < len(p) else 0 for d, p in zip(done, prompts)])
    return [(torch.cat([o.logits for o in outs]), torch.cat([o.taps for o in outs]) if taps else None)
            for outs in got]


def assert_matches_transformers(model, hf, rtol: float = 1e-4) -> None:
    """PLAN's prompts through our model against HF's whole-sequence forward: logits and the taps of every layer (the
    last final-normed) within rtol of the reference's largest magnitude."""
    n, H = model.config.num_hidden_layers, model.config.hidden_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (length,), generator=g) for length, _, _ in PLAN]
    ours = prefill_decode(model, prompts, list(range(n)))
    for p, (logits, taps) in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(p[None], output_hidden_states=True)
        scale = ref.logits.abs().max().item()
        assert (logits - ref.logits[0]).abs().max().item() <= rtol * scale, len(p)
        for i in range(n):
            want = ref.hidden_states[i + 1][0]
            err = (taps[:, i * H:(i + 1) * H] - want).abs().max().item()
            assert err <= rtol * want.abs().max().item(), (len(p), i, err)


# ---- engine tests: a plain decoding oracle and trained hybrid pairs ---------------------------------------------

_plain_memo: dict = {}


def plain_generate(lm, prompt: Sequence[int], params) -> tuple[list[int], str]:
    """(token ids, finish reason) of plain single-request decoding of a hybrid target at the model level (no engine):
    the prompt in one forward, then one row a step over the paged pool and one state slot, each token the target's
    own sample at its position (argmax when greedy), the engine's stop and length rules. Memoized."""
    from blockspec.sampling import sample

    key = (id(lm), tuple(prompt), repr(params))
    if key in _plain_memo:
        return _plain_memo[key]
    max_new = min(params.max_tokens, lm.config.max_position_embeddings - len(prompt))
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(lm.stop_token_ids))
    runner = PagedRunner(lm.model, 1, len(prompt) + max_new)
    seed = params.resolve_seed()
    out, _ = runner.forward([(0, list(prompt))])
    logits, tokens, reason = out.logits[-1:], [], "length"
    for i in range(max_new):
        t = int(sample(logits, params, seed, torch.tensor([len(prompt) + i]))[0])
        tokens.append(t)
        if t in stops:
            reason = "stop"
            break
        if i + 1 < max_new:
            logits = runner.forward([(0, [t])])[0].logits
    _plain_memo[key] = (tokens, reason)
    return tokens, reason


LIN, FULL = "linear_attention", "full_attention"
# Cycles whose every other token is the same (40, or 41): what follows it is the token two back plus one, so the
# target must carry its context through the conv window and the recurrent state (tests/trained_pair.py's cycles are a
# bigram each: a target trained on them predicts well whatever its state holds, and would hide a wrong rollback)
CYCLE_C = [t for i in range(10, 20) for t in (i, 40)]
CYCLE_D = [t for i in range(20, 30) for t in (i, 41)]


@dataclass
class HybridPair:
    """A tiny hybrid target trained on CYCLE_C / CYCLE_D, and drafters of it that draft well."""

    lm: Any  # the target (layers: linear, full, linear)
    draft: Any  # a DFlash drafter trained on its taps of layers 0 (linear) and 1 (full attention)
    draft2: Any  # that drafter's weights as a DFlash 2 drafter (convolutions near the identity, a strong selector)
    draft_model: Any  # a dense tiny llama trained on the same cycles: a classic draft model for the target


_PAIRS: dict[bool, HybridPair] = {}


def trained_hybrid_pair(moe: bool) -> HybridPair:
    """Built once per process and kind (a few seconds each; callers must not modify the models): the target learns
    CYCLE_C / CYCLE_D (trained_pair.train_target, its cycles swapped for these meanwhile), a random z-lab drafter is
    trained on its taps (trained_pair.train_draft) and copied into a DFlash 2 checkpoint as
    tests/test_dflash2_reference.py does, and a dense llama learns the cycles as a draft model."""
    if moe in _PAIRS:
        return _PAIRS[moe]
    import atexit
    import shutil
    import tempfile

    import trained_pair as tp
    from blockspec.config import SpeculativeConfig
    from blockspec.loading.draft_loader import load_draft
    from blockspec.loading.loader import LoadConfig, load_model
    from blockspec.train.export import hf_state_dict
    from dflash_utils import make_zlab_draft, make_zlab_draft2
    from hf_utils import make_hf_model, save_hf_model

    root = Path(tempfile.mkdtemp(prefix="blockspec_hybrid_pair_"))
    atexit.register(shutil.rmtree, root, True)
    cpu = LoadConfig(device="cpu", with_tokenizer=False)
    old, cycles = torch.get_num_threads(), tp.CYCLES
    torch.set_num_threads(1)  # tiny matmuls: extra threads only add synchronisation cost
    tp.CYCLES = [CYCLE_C, CYCLE_D]  # what train_target and train_draft read
    try:
        hf = make_hf(2 if moe else 0, moe=moe, vocab_size=tp.VOCAB, num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
                     max_position_embeddings=tp.MAX_POSITIONS)
        tp.train_target(hf)
        save(hf, root / "target")
        make_zlab_draft(hf.config, root / "draft", layers=1, block_size=tp.BLOCK, target_layer_ids=tp.TAPS,
                        mask_token_id=tp.MASK, seed=0)
        lm = load_model(str(root / "target"), cpu)
        draft = load_draft(SpeculativeConfig(draft_model=str(root / "draft")), lm)
        tp.train_draft(lm, draft)
        make_zlab_draft2(hf.config, root / "draft2", layers=1, block_size=tp.BLOCK, target_layer_ids=tp.TAPS,
                         mask_token_id=tp.MASK, conv_group_size=8, selector_rank=8, selector_top_k=4,
                         codebook_scale=2.5, conv_noise=0.1, init=hf_state_dict(draft.model))
        draft2 = load_draft(SpeculativeConfig(draft_model=str(root / "draft2")), lm)
        dense = make_hf_model("llama", seed=1, vocab_size=tp.VOCAB, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=tp.MAX_POSITIONS)
        tp.train_target(dense)
        save_hf_model(dense, root / "draft_model")
        draft_model = load_model(str(root / "draft_model"), cpu)
    finally:
        torch.set_num_threads(old)
        tp.CYCLES = cycles
    _PAIRS[moe] = HybridPair(lm, draft, draft2, draft_model)
    return _PAIRS[moe]
