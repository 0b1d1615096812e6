"""The native decoder stack (blockspec/native/decoder.c, driven by loading/native_stack.py) that --cpu-quant q4 runs
where the kernels build: it computes what the torch layers on the same q4 weights compute (to fp32 rounding: its exp,
sums and norms are its own), each row bit for bit the same whatever the other rows of the call, their sequences and
the thread count, and so greedy speculative decoding through it equals plain decoding."""

from __future__ import annotations

import pytest
import torch

from blockspec.attention.paged_ref import PagedBatch, RowwiseTargetAttention
from blockspec.config import EngineConfig
from blockspec.kv.pool import CacheShape, KVPool
from blockspec.llm import LLM
from blockspec.loading.loader import LoadConfig, load_model
from blockspec.native import q4
from blockspec.speculative.ngram import NgramProposer
from engine_utils import greedy
from hf_utils import make_hf_model, save_hf_model
from paged_utils import batch_of

pytestmark = pytest.mark.skipif(q4.library() is None, reason="no C compiler here: q4 runs torch's layers")
BLOCK = 4
SHAPE = dict(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def lm(request, tmp_path_factory):
    """A tiny q4 target of each family on the native stack (qwen2: q/k/v biases, qwen3: q/k head norms)."""
    src = save_hf_model(make_hf_model(request.param, seed=11, **SHAPE), tmp_path_factory.mktemp("native") / "t")
    lm = load_model(str(src), LoadConfig(device="cpu", with_tokenizer=False, cpu_quant="q4"))
    assert lm.model.executor is not None
    return lm


def new_pool(lm) -> KVPool:
    cfg = lm.config
    return KVPool(16, BLOCK, CacheShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim), None,
                  torch.float32, torch.device("cpu"))


def forward(lm, pool: KVPool, b: PagedBatch, ids: list[int], taps=(0, 2)):
    with torch.no_grad():
        out = lm.model(torch.tensor(ids), b.positions, RowwiseTargetAttention(pool, b), tap_layers=taps)
    return out.logits, out.taps


TOKENS = [5, 17, 42, 3, 88, 64, 7, 23, 11, 90, 31, 2, 77, 45, 9, 60, 14, 28, 39, 50, 71, 80, 8, 19, 33, 1]
TABLE_A, TABLE_B = [3, 0, 7, 5, 9, 1, 11], [2, 8, 4, 6, 10, 12, 13]  # blocks out of order: the table is read


def test_native_stack_computes_the_torch_layers(lm):
    native = lm.model.executor
    outs = []
    for stack in (native, None):
        lm.model.executor = stack
        pool = new_pool(lm)
        prefill = forward(lm, pool, batch_of([(TABLE_A, 0, 9)]), TOKENS[:9])
        verify = forward(lm, pool, batch_of([(TABLE_A, 9, 5)]), TOKENS[9:14])
        outs.append([torch.cat([prefill[0], verify[0]]), torch.cat([prefill[1], verify[1]])])
    lm.model.executor = native
    for got, want in zip(*outs):  # the logits: the int8 head rounds its output to bf16 (~0.4 % steps)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * float(want.abs().max()))
    assert not torch.equal(outs[0][1], outs[1][1])  # the native stack really ran: its fp32 rounding is its own


def test_rows_alone_equal_rows_together_at_every_count_and_thread_count(lm):
    """Rows 9.. of sequence A as one call of M rows beside 3 rows of sequence B, and each alone, at 1 and 2 threads:
    the same bits (logits and taps)."""
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            pool = new_pool(lm)
            forward(lm, pool, batch_of([(TABLE_A, 0, 9), (TABLE_B, 0, 4)]), TOKENS[:9] + TOKENS[12:16])
            alone = [forward(lm, pool, batch_of([(TABLE_A, 9 + i, 1)]), [TOKENS[9 + i]]) for i in range(17)]
            for M in (1, 2, 5, 16, 17):
                logits, taps = forward(lm, pool, batch_of([(TABLE_B, 4, 3), (TABLE_A, 9, M)]),
                                       TOKENS[16:19] + TOKENS[9:9 + M])
                assert torch.equal(logits[3:], torch.cat([a[0] for a in alone[:M]])), (t, M)
                assert torch.equal(taps[3:], torch.cat([a[1] for a in alone[:M]])), (t, M)
            results.append(torch.cat([a[0] for a in alone]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_speculative_output_equals_plain_through_the_native_stack(lm):
    """n-gram drafts on repetitive prompts (a random target falls into loops), verified K + 1 rows at a time through
    the native stack: the greedy tokens are plain decoding's, and drafts were accepted."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42], [3, 9, 27, 81, 3, 9, 27, 81, 3]]
    plain = [o.token_ids for o in LLM.from_loaded(lm, None, engine=EngineConfig(max_num_seqs=3, block_size=BLOCK))
             .generate(prompts, greedy(40), use_tqdm=False)]
    spec = LLM.from_loaded(lm, NgramProposer(4, 3), engine=EngineConfig(max_num_seqs=3, block_size=BLOCK))
    outs = spec.generate(prompts, greedy(40), use_tqdm=False)
    assert [o.token_ids for o in outs] == plain
    assert sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs) > 10


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory):
    """The kernels built with a partials budget that forces a pass per query row, and the portable build."""
    from blockspec.native import build, lib

    libs = []
    for flags in (["-DATTN_PART_BUDGET=1024"], ["-DBLOCKSPEC_PORTABLE"]):
        built = build.build(flags, tmp_path_factory.mktemp("native"))
        assert built.library is not None, built.reason
        libs.append(lib.load(built.library))
    return libs


def test_rows_across_key_tiles_equal_alone_and_under_every_build(lm, other_builds, monkeypatch):
    """Past one tile of keys (attend.c: 64 a tile, partials combined in tile order): rows 60..70 and 125..131 of a
    150-token sequence, together beside another sequence and each alone, at 1 and 2 threads, give the same bits; and
    so do a build whose partials budget forces a pass per row and the portable build (fmaf for the fused adds)."""
    table = list(range(60))[::-1]  # 240 slots, blocks in reverse: the table is read
    other = list(range(60, 64))
    ids = torch.randint(0, SHAPE["vocab_size"], (160,), generator=torch.Generator().manual_seed(4)).tolist()

    def run() -> list[torch.Tensor]:
        pool = KVPool(64, BLOCK, CacheShape(lm.config.num_hidden_layers, lm.config.num_key_value_heads,
                                            lm.config.head_dim), None, torch.float32, torch.device("cpu"))
        outs = [torch.cat(forward(lm, pool, batch_of([(table, 0, 150), (other, 0, 5)]), ids[:150] + ids[:5]), 1)]
        for first, n in ((60, 11), (125, 7)):
            together = torch.cat(forward(lm, pool, batch_of([(other, 5, 2), (table, first, n)]),
                                         ids[5:7] + ids[first:first + n]), 1)[2:]
            alone = torch.cat([torch.cat(forward(lm, pool, batch_of([(table, first + i, 1)]), [ids[first + i]]), 1)
                               for i in range(n)])
            assert torch.equal(together, alone), (first, n)
            outs.append(alone)
        return outs

    threads = torch.get_num_threads()
    native = lm.model.executor
    try:
        lm.model.executor = None  # the torch layers: what every tile's partials must combine to
        want = run()
        lm.model.executor = native
        results = []
        for t in (1, 2):
            torch.set_num_threads(t)
            results.append(run())
        for other_lib in other_builds:
            monkeypatch.setattr(q4, "library", lambda: other_lib)
            results.append(run())
            monkeypatch.undo()
    finally:
        torch.set_num_threads(threads)
        lm.model.executor = native
    for got, ref in zip(results[0], want):  # logits and taps, as test_native_stack_computes_the_torch_layers
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-2 * float(ref.abs().max()))
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))
