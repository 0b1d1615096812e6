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
