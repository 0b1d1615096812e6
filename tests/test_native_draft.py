"""The native drafter (blockspec/native/draft.c, driven by loading/native_stack.py) that a DFlash drafter runs on
under a native q4 target: it computes the torch drafter on the same Q8_0 weights (to the rounding of its int8
activations), a block's drafts do not depend on the other blocks of the call or the thread count, and greedy DFlash
through it equals plain decoding."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import AutoConfig

from blockspec.attention.paged_ref import PagedBatch, PagedDraftAttention, store
from blockspec.config import EngineConfig, SpeculativeConfig
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.layers.cpu_quant import reference_weight
from blockspec.llm import LLM
from blockspec.loading.draft_loader import load_draft
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.loading.native_stack import NativeDraft, draft_fallback
from blockspec.native import q4
from dflash_utils import make_zlab_draft
from engine_utils import greedy
from hf_utils import make_hf_model, save_hf_model

pytestmark = pytest.mark.skipif(q4.library() is None, reason="no C compiler here: the drafter runs torch's layers")
BLOCK, ROWS, MASK, TAPS = 4, 8, 95, (0, 2)
SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny q4 target on the native stack and a random 2-layer drafter of native-friendly dims."""
    root = tmp_path_factory.mktemp("native_draft")
    src = save_hf_model(make_hf_model("llama", seed=5, **SHAPE), root / "t")
    lm = load_model(str(src), LoadConfig(device="cpu", with_tokenizer=False, cpu_quant="q4"))
    make_zlab_draft(AutoConfig.from_pretrained(str(src)), root / "d", layers=2, block_size=ROWS,
                    target_layer_ids=TAPS, mask_token_id=MASK, intermediate_size=96, head_dim=32, scale=3.0)
    draft = load_draft(SpeculativeConfig(draft_model=str(root / "d"), num_draft_tokens=ROWS - 1), lm)
    assert lm.model.executor is not None and draft.model.executor is not None
    return lm, draft, root


def new_pool(draft) -> KVPool:
    cfg = draft.config
    shape = CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    return KVPool(16, BLOCK, shape, shape, torch.float32, torch.device("cpu"))


TABLE_A, TABLE_B = [3, 0, 7, 5, 9, 1], [2, 8, 4, 6, 10, 11]


def fill_context(model, pool: KVPool, table: list[int], n: int, seed: int) -> None:
    """Draft context of positions 0..n-1 (random taps) written through the model's context append."""
    taps = torch.randn(n, len(TAPS) * SHAPE["hidden_size"], generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(n)
    slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)])
    with torch.no_grad():
        kvs = model.context_kv(taps, pos, lambda layer: (pool.draft_k[layer], pool.draft_v[layer], slots))
    for layer, (k, v) in enumerate(kvs):
        if k is not None:
            store(pool.draft_k[layer], pool.draft_v[layer], k, v, slots)


def blocks(model, pool: KVPool, runs: list[tuple[list[int], int, int]], embeds: torch.Tensor,
           outputs: tuple[int, int] | None = None) -> torch.Tensor:
    """runs: per sequence (block table, block start, first embed row) -> the blocks' final hidden [B * ROWS, H];
    outputs: the model's (rows a..b-1 of each block read)."""
    pos = torch.cat([torch.arange(s, s + ROWS) for _, s, _ in runs])
    width = max(len(t) for t, _, _ in runs)
    batch = PagedBatch(pos, torch.full_like(pos, -1), torch.arange(len(runs) + 1, dtype=torch.int32) * ROWS,
                       torch.tensor([s for _, s, _ in runs], dtype=torch.int32),
                       torch.tensor([t + [0] * (width - len(t)) for t, _, _ in runs]), ROWS)
    x = torch.cat([embeds[e:e + ROWS] for _, _, e in runs])
    with torch.no_grad():
        return model(x, pos, PagedDraftAttention(pool, batch), ROWS, outputs=outputs)


def q8_reference(model):
    """The torch drafter on the weights the native one computes with: every linear's Q8_0 dequantization."""
    native, model.executor = model.executor, None  # ctypes structs do not copy
    try:
        ref = copy.deepcopy(model)
    finally:
        model.executor = native
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2 and not name.startswith("rotary"):
                p.copy_(reference_weight("q8", p, native=True))
    return ref


def test_native_drafter_computes_the_torch_drafter_on_its_q8_weights(pair):
    _, draft, _ = pair
    embeds = torch.randn(2 * ROWS, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(4))
    outs = []
    for model in (draft.model, q8_reference(draft.model)):
        pool = new_pool(draft)
        fill_context(model, pool, TABLE_A, 13, seed=1)
        fill_context(model, pool, TABLE_B, 6, seed=2)
        outs.append((blocks(model, pool, [(TABLE_A, 13, 0), (TABLE_B, 6, ROWS)], embeds),
                     pool.draft_k.clone(), pool.draft_v.clone()))
    for got, want in zip(*outs):  # int8 activations: each input off by at most half its block's step
        torch.testing.assert_close(got, want, rtol=0, atol=3e-2 * float(want.abs().max()))
    assert not torch.equal(outs[0][0], outs[1][0])  # the native drafter really ran


def two_blocks(draft, seed: int, len_a: int, len_b: int):
    """A pool holding two sequences' drafter context (len_a and len_b tokens), the runs of one block after each and
    the blocks' input embeddings."""
    embeds = torch.randn(2 * ROWS, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(seed))
    pool = new_pool(draft)
    fill_context(draft.model, pool, TABLE_A, len_a, seed=seed + 1)
    fill_context(draft.model, pool, TABLE_B, len_b, seed=seed + 2)
    return pool, [(TABLE_A, len_a, 0), (TABLE_B, len_b, ROWS)], embeds


@contextlib.contextmanager
def torch_threads():
    """torch.set_num_threads inside the block, the caller's count restored after it."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_a_block_is_the_same_alone_and_beside_another_at_any_thread_count(pair):
    _, draft, _ = pair
    pool, runs, embeds = two_blocks(draft, 6, 10, 17)
    with torch_threads():
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            both = blocks(draft.model, pool, runs, embeds)
            alone = torch.cat([blocks(draft.model, pool, [run], embeds) for run in runs])
            assert torch.equal(both, alone), threads
            results.append(both)
        assert torch.equal(results[0], results[1])


def test_a_last_layer_of_the_read_rows_only_gives_those_rows_bit_for_bit(pair):
    """outputs=(a, b): rows a..b-1 of each block as the full pass computes them, zeros elsewhere, at any threads."""
    _, draft, _ = pair
    pool, runs, embeds = two_blocks(draft, 8, 11, 3)
    full = blocks(draft.model, pool, runs, embeds).view(2, ROWS, -1)
    with torch_threads():
        for threads, (a, b) in [(1, (1, 4)), (2, (1, 4)), (2, (0, ROWS)), (2, (5, 6))]:
            torch.set_num_threads(threads)
            got = blocks(draft.model, pool, runs, embeds, outputs=(a, b)).view(2, ROWS, -1)
            assert torch.equal(got[:, a:b], full[:, a:b]), (threads, a, b)
            assert not got[:, :a].any() and not got[:, b:].any()


def test_greedy_dflash_through_the_native_drafter_equals_plain_decoding(pair, monkeypatch):
    lm, draft, _ = pair
    calls = {"forward": 0, "context": 0}
    for name in calls:
        fn = getattr(NativeDraft, name)

        def counted(self, *a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(self, *a, **kw)
        monkeypatch.setattr(NativeDraft, name, counted)
    prompts = [[(7 * i + 3 * j) % 90 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = greedy(24)
    plain = LLM.from_loaded(lm, None,
                            engine=EngineConfig(max_num_seqs=4,
                                                block_size=BLOCK)).generate(prompts, params, use_tqdm=False)
    spec = LLM.from_loaded(lm, draft,
                           engine=EngineConfig(max_num_seqs=4,
                                               block_size=BLOCK)).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert calls["forward"] > 0 and calls["context"] > 0


def test_drafters_the_native_path_cannot_run_keep_the_torch_layers(pair):
    lm, _, root = pair
    make_zlab_draft(AutoConfig.from_pretrained(str(root / "t")), root / "d16", layers=1, block_size=ROWS,
                    target_layer_ids=TAPS, mask_token_id=MASK)  # head_dim 16: not whole blocks of 32
    draft = load_draft(SpeculativeConfig(draft_model=str(root / "d16"), num_draft_tokens=3), lm)
    assert draft.model.executor is None and draft_fallback(draft.model, lm.model) is not None
